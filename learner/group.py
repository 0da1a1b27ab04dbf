"""LearnerGroup: the LearnerWorker ranks as named Ray actors, driven as one.

Every call fans out to all ranks and waits with a timeout, so a dead or failed rank
surfaces as an error naming it instead of a hang.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import numpy as np

from core.rollout import ScoredRollout
from learner.config import LearnerConfig
from learner.weight_sync import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)


class LearnerGroup:
    """``world_size`` LearnerWorker ranks as named Ray actors (``learner-0``, ...).

    Every call fans out to all ranks and waits with a timeout; a failed or dead rank
    surfaces as an error naming it (the other ranks then fail their collectives at
    ``dist_timeout_s``: shut the group down and recreate it).
    """

    def __init__(self, *, model: str, config: LearnerConfig | dict, world_size: int,
                 num_cpus_per_rank: float = 1, num_gpus_per_rank: float = 0, placement_group=None,
                 name_prefix: str = "learner", start_timeout_s: float = 600.0,
                 call_timeout_s: float = 1800.0) -> None:
        import ray

        from learner.worker import LearnerWorker, node_ip_and_free_port  # worker.py re-exports this module

        self.config = config if isinstance(config, LearnerConfig) else LearnerConfig.from_dict(config)
        self.config.validate(world_size)
        self.world_size, self.call_timeout_s = world_size, call_timeout_s
        self.dropped_rollouts = 0
        addr, port = ray.get(ray.remote(num_cpus=0)(node_ip_and_free_port).options(
            **self._placement(placement_group, 0)).remote(), timeout=start_timeout_s)
        env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")} if not num_gpus_per_rank else {}
        actor = ray.remote(LearnerWorker)
        self.workers = [
            actor.options(name=f"{name_prefix}-{r}", num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank,
                          runtime_env={"env_vars": env} if env else None,
                          **self._placement(placement_group, r)).remote(
                rank=r, world_size=world_size, model=model, config=self.config,
                master_addr=addr, master_port=port)
            for r in range(world_size)]
        try:
            self._call("health", timeout=start_timeout_s)
        except Exception:
            self.shutdown()  # the surviving ranks would wait in the rendezvous until its timeout
            raise

    @staticmethod
    def _placement(pg, bundle: int) -> dict:
        if pg is None:
            return {}
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle)}

    def _call(self, method: str, *args_per_rank, timeout: Optional[float] = None, **kwargs) -> list:
        """Call ``method`` on every rank (positional args: one list entry per rank) and gather."""
        refs = [getattr(w, method).remote(*(a[r] for a in args_per_rank), **kwargs)
                for r, w in enumerate(self.workers)]
        return _gather(refs, method, timeout or self.call_timeout_s)

    def shards(self, rollouts: list) -> list[list]:
        """Interleaved equal shards (rank r gets rows r, r+W, ...): with shuffle off, global
        minibatch k is then rows k*M .. k*M+M-1, as in a single process. The remainder
        (len % W) is dropped: ranks must run the same number of collectives."""
        keep = len(rollouts) - len(rollouts) % self.world_size
        if keep < len(rollouts):
            log.warning("learner: dropping %d rollouts so %d ranks get equal shards",
                        len(rollouts) - keep, self.world_size)
        self.dropped_rollouts += len(rollouts) - keep
        if keep == 0:
            raise ValueError(f"learner.train: {len(rollouts)} rollouts cannot fill {self.world_size} ranks")
        return [list(rollouts[r:keep:self.world_size]) for r in range(self.world_size)]

    def train(self, rollouts: list[ScoredRollout], ptx_batch: Optional[list] = None) -> dict:
        t0 = time.perf_counter()
        shards = self.shards(rollouts)
        ptx = None
        if ptx_batch is not None:
            many = len(ptx_batch) >= self.world_size
            ptx = [list(ptx_batch[r::self.world_size]) if many else list(ptx_batch)
                   for r in range(self.world_size)]
        results = self._call("train", shards, ptx or [None] * self.world_size)
        metrics = _merge_metrics(results)
        metrics["perf/learner_group_seconds"] = time.perf_counter() - t0
        metrics["learner/dropped_rollouts"] = self.dropped_rollouts
        return metrics

    def push_weights(self, generators: list, version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict:
        return self._call("push_weights", generators=generators, version=version,
                          bucket_bytes=bucket_bytes)[0]

    def state_dict(self) -> dict:
        """Full tensors of the trained module (gathered on rank 0)."""
        return self._call("full_state_dict")[0]

    def save(self, out_dir) -> str:
        return self._call("save", out_dir=str(out_dir))[0]

    def load(self, in_dir) -> int:
        return self._call("load", in_dir=str(in_dir))[0]

    def save_pretrained_policy(self, out_dir) -> str:
        return self._call("save_pretrained_policy", out_dir=str(out_dir))[0]

    def health(self) -> list[dict]:
        """Per-rank dicts. Queued behind a running call (actors run one call at a time);
        a dead rank still answers at once with an error."""
        return self._call("health")

    def shutdown(self) -> None:
        import ray
        for w in self.workers:
            ray.kill(w)
        self.workers = []


def _gather(refs: list, what: str, timeout: float) -> list:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    rank_of = {ref: r for r, ref in enumerate(refs)}
    results: list = [None] * len(refs)
    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            ranks = sorted(rank_of[r] for r in pending)
            raise GetTimeoutError(f"learner {what}: rank(s) {ranks} did not answer within {timeout:.0f}s")
        rank = rank_of[ready[0]]
        try:
            results[rank] = ray.get(ready[0])
        except RayTaskError as e:
            _drain(pending)
            cause = e.cause if getattr(e, "cause", None) is not None else e
            kind = ValueError if isinstance(cause, ValueError) else RuntimeError
            raise kind(f"learner rank {rank} failed in {what}: {type(cause).__name__}: {cause}") from e
        except RayActorError as e:
            raise RuntimeError(f"learner rank {rank} died during {what}: {e}") from e
    return results


def _drain(refs: list, timeout: float = 2.0) -> None:
    """Collect the other ranks' (usually identical) errors so Ray does not log them as unhandled."""
    import ray
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # noqa: BLE001 - the first rank's error is the one raised
            pass


def _merge_metrics(per_rank: list[dict]) -> dict:
    """Workers already all-reduce, so values agree; mean for safety, lr from rank 0, slowest time."""
    out = {}
    for key in per_rank[0]:
        values = [m[key] for m in per_rank]
        if key == "ppo/lr":
            out[key] = values[0]
        elif key == "perf/learner_seconds":
            out[key] = max(values)
        else:
            out[key] = float(np.mean(values))
    return out

"""LearnerWorker: one DeepSpeed ZeRO rank, the facade Ray wraps (learner/group.py drives the ranks).

It composes the parts along their duties: the PPO update (update.py), the weights out
(export.py), the checkpoints (checkpoint.py).

Start-up. In-process with one rank (``start=True``, the default) the constructor does
everything. A group of ranks on Ray starts in phases, because the ranks' constructors
run concurrently and rank 0 must own the store before anyone can connect to it:
``LearnerWorker(..., start=False)`` (cheap) -> rank 0 ``open_store()`` -> every rank
``join(address)`` -> every rank ``build()``.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from core.rollout import ScoredRollout
from core.threads import fit_threads
from core.transfer import Pull, pull_args
from learner import rendezvous
from learner.checkpoint import Checkpointer
from learner.collectives import Collectives
from learner.config import LearnerConfig
from learner.engine import MODEL_KINDS, build_engine, pad_token_id
from learner.export import WeightExporter
from learner.preference import PreferenceStep
from learner.sft import SFTStep
from learner.update import PPOUpdate
from learner.weight_sync import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

TO_LEARNER = "transfer/to_learner"  # train()'s transfer/to_learner_{bytes,seconds,local_bytes}


class LearnerWorker:
    """One data-parallel rank. A plain class; cluster code wraps it with ray.remote.

    ``config``: a LearnerConfig is taken as validated (the driver did it once); a dict
    goes through ``LearnerConfig.from_dict`` for this world size.
    ``kind``: "policy" (PPO and SFT train the policy with its value head) or "reward" (a
    reward model: a sequence classifier fitted to preference pairs).
    """

    def __init__(self, *, rank: int, world_size: int, model: str, config: LearnerConfig | dict,
                 start: bool = True, kind: str = "policy") -> None:
        fit_threads()
        if not isinstance(config, LearnerConfig):
            config = LearnerConfig.from_dict({**config, "world_size": world_size})
        if kind not in MODEL_KINDS:
            raise ValueError(f"learner: kind={kind!r} is unknown; use one of {MODEL_KINDS}")
        self.kind = kind
        config.check_device(torch.cuda.is_available())
        self.config, self.rank, self.world_size, self.model_path = config, rank, world_size, str(model)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.backend: Optional[str] = None
        self._store = None  # rank 0: the store server; it must live as long as the group
        self.update: Optional[PPOUpdate] = None
        self.exporter: Optional[WeightExporter] = None
        self.checkpoints: Optional[Checkpointer] = None
        self.sft: Optional[SFTStep] = None  # the supervised step of this kind (learner/sft.py, preference.py)
        self.preference: Optional[PreferenceStep] = None
        if start:
            if world_size != 1:
                raise ValueError(f"learner: {world_size} ranks start through LearnerGroup (start=False, "
                                 "then open_store on rank 0, join and build on every rank)")
            self.join(None if dist.is_initialized() else self.open_store())
            self.build()

    # ------------------------------------------------------------------ start-up phases

    def open_store(self) -> rendezvous.StoreAddress:
        """Rank 0: open the rendezvous store on a port the OS picks, and say where it is."""
        if self.rank != 0:
            raise RuntimeError(f"learner rank {self.rank}: only rank 0 opens the store")
        self._store, address = rendezvous.open_store(self.world_size, self.config.dist_timeout_s)
        return address

    def join(self, address: Optional[rendezvous.StoreAddress]) -> None:
        """Join the process group at rank 0's store (raises rendezvous.RendezvousError)."""
        self.backend = rendezvous.join_process_group(self.rank, self.world_size, address,
                                                     self.config.dist_timeout_s, store=self._store)

    def build(self) -> dict:
        """Load the policy into its DeepSpeed engine and wire the parts; returns health()."""
        if self.backend is None:
            raise RuntimeError(f"learner rank {self.rank}: build() before join()")
        engine = build_engine(self.model_path, self.config, self.world_size, kind=self.kind)
        comm = Collectives(world_size=self.world_size,
                           device=self.device if self.backend == "nccl" else torch.device("cpu"))
        parts = dict(engine=engine, config=self.config, rank=self.rank, world_size=self.world_size,
                     collectives=comm, device=self.device, pad_id=pad_token_id(engine.module.config))
        self.update = PPOUpdate(**parts)  # also keeps the step count that checkpoints save
        if self.kind == "reward":
            self.preference = PreferenceStep(**parts)
        else:
            self.sft = SFTStep(**parts)
        self.exporter = WeightExporter(engine=engine, config=self.config, rank=self.rank)
        self.checkpoints = Checkpointer(engine=engine, exporter=self.exporter, collectives=comm, rank=self.rank)
        return self.health()

    # ------------------------------------------------------------------ training

    def train(self, shard: list[ScoredRollout] | Pull, ptx_rows: Optional[np.ndarray] = None,
              kl_coef: float = 0.0) -> dict:
        """One PPO update (``ppo_epochs`` passes) on this rank's shard, with this rank's
        [n, T] PTX rows when ``ppo.ptx_coef`` > 0 and beta ``kl_coef`` for a KL loss term;
        every rank must call it. A shard in a core.transfer.Pull is pulled here: what that
        moved between nodes comes back as ``transfer/to_learner_*`` (0 for a plain list)."""
        (shard,), moved = pull_args(shard)
        return {**self.update.train(shard, ptx_rows, kl_coef), **moved.as_metrics(TO_LEARNER)}

    def ptx_rows(self) -> Optional[np.ndarray]:
        """The PTX rows this rank trained on in its last update (for checks and debugging)."""
        return self.update.last_ptx_rows

    def policy_logprobs(self, rollouts: list) -> list[np.ndarray]:
        """[R] logprobs of each rollout's response under the current weights (all ranks call)."""
        return self.update.policy_logprobs(rollouts)

    @property
    def epoch_history(self) -> list[dict]:
        """This rank's per-epoch policy/value loss, clip fraction and approx KL of the last train()."""
        return self.update.epoch_history

    # ------------------------------------------------------------------ SFT and reward model

    def sft_train(self, examples: list) -> dict:
        """SFT optimizer steps on this rank's equal share of (prompt_ids, response_ids) examples."""
        return self._built(self.sft, "sft_train").train(examples)

    def sft_evaluate(self, examples: list) -> dict:
        return self._built(self.sft, "sft_evaluate").evaluate(examples)

    def rm_train(self, pairs: list, margin: float = 0.0) -> dict:
        """Bradley-Terry optimizer steps on this rank's equal share of (prompt, chosen, rejected) ids."""
        return self._built(self.preference, "rm_train").train(pairs, margin)

    def rm_evaluate(self, pairs: list, margin: float = 0.0) -> dict:
        return self._built(self.preference, "rm_evaluate").evaluate(pairs, margin)

    def rm_scores(self, sequences: list) -> np.ndarray:
        """[N] reward-model scores of (prompt_ids, response_ids) items."""
        return self._built(self.preference, "rm_scores").scores(sequences)

    def _built(self, step, what: str):
        """``step`` (this rank's SFT or preference step), or a one-line error if this kind has none."""
        if step is None:
            raise ValueError(f"learner.{what}: this rank was built with kind={self.kind!r}, which has no "
                             f"{what.split('_')[0].upper()} step; start the group with the other kind")
        return step

    # ------------------------------------------------------------------ weights out

    def named_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        """Full LM tensors with HF names on rank 0 (nothing elsewhere). ALL ranks must iterate it."""
        return self.exporter.named_weights(bucket_bytes)

    @property
    def tied_embeddings(self) -> bool:
        return self.exporter.tied_embeddings

    def full_state_dict(self) -> Optional[dict]:
        return self.exporter.full_state_dict()

    def push_weights(self, generators: Mapping, version: int,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[dict]:
        """Send the LM to ``generators`` (replica id -> Generator actor handle); rank 0 reports."""
        return self.exporter.push_weights(generators, version, bucket_bytes)

    def shutdown_weight_sync(self) -> None:
        self.exporter.shutdown_weight_sync()

    # ------------------------------------------------------------------ checkpoints

    def save(self, out_dir) -> str:
        return self.checkpoints.save(out_dir, step=self.update.step)

    def load(self, in_dir) -> int:
        self.update.step = self.checkpoints.load(in_dir)  # reseeds the shuffle as the saved run had it
        return self.update.step

    def save_pretrained_policy(self, out_dir) -> Optional[str]:
        return self.checkpoints.save_pretrained_policy(out_dir)

    def health(self) -> dict:
        """Cheap: no collective, no tensor."""
        built = self.update is not None
        return {"rank": self.rank, "pid": os.getpid(), "world_size": self.world_size, "ok": True, "built": built,
                "step": self.update.step if built else 0,
                "optimizer_steps": int(self.update.engine.global_steps) if built else 0,
                "zero_stage": self.config.zero_stage, "backend": self.backend, "device": str(self.device),
                "model": self.model_path, "kind": self.kind, **(self._dtypes() if built else {})}

    def _dtypes(self) -> dict:
        """The dtype the model computes in, and the optimizer's (DeepSpeed bf16 keeps fp32
        master weights: its wrapped torch optimizer steps those, not the bf16 module's)."""
        engine = self.update.engine
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        # ZeRO-3 hands its torch optimizer the flat fp32 partitions only inside step()
        master = next((p for g in inner.param_groups for p in g["params"]), None)
        if master is None:
            master = engine.optimizer.fp32_partitioned_groups_flat[0]
        name = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
        return {"dtype": name(next(engine.module.parameters())), "master_dtype": name(master)}

"""EngineWeights: the receiving side of weight updates for one generator's vLLM engine.

It owns the engine's policy version and implements the learner -> generator contract
(``core.weights.WeightReceiver``) for both transports: "cpu" reloads safetensors buckets in
place through the worker extension (actors/vllm_extension.py); "nccl" forwards to the
RLOfflineMixin methods of ``vllm.LLM`` (entrypoints/rl/offline.py), which fan out to the
workers with collective_rpc: only metadata crosses Ray, the tensors arrive over NCCL.

Every update waits for the engine's turn (actors/engine_turns.py, shared with sampling): the
end of a generate call or, with partial rollouts, the end of the current engine step. New
weights drop every KV block the old ones computed and label the next tokens with the new version.
"""
from __future__ import annotations

import time

from actors.engine_turns import EngineTurns


class EngineWeights:
    """The weights of one vLLM engine (``llm``): their version, and how new ones come in."""

    def __init__(self, *, llm, turns: EngineTurns, name: str, weight_sync: str = "cpu",
                 partial_rollouts: bool = False) -> None:
        self._llm, self._turns = llm, turns
        self.name, self.weight_sync, self.partial_rollouts = name, weight_sync, bool(partial_rollouts)
        self._set_version(0)  # vLLM labels each token with it

    def version(self) -> int:
        return self._version

    def rewind(self, version: int) -> None:
        """A rollback to a checkpoint: the next weights pushed are that (older) version's."""
        with self._turns.updating():
            self._set_version(int(version))

    def load_weights(self, version: int, buckets: list[bytes]) -> dict:
        """Reload the policy in place from safetensors-serialised buckets; record `version`.
        Waits for the engine's turn: the end of a generate call, or with partial rollouts
        the end of the current engine step."""
        self._refuse_older(version, "load_weights")
        waited = time.perf_counter()
        with self._turns.updating():
            t0 = time.perf_counter()
            self._pause()
            counts = self._llm.collective_rpc("tether_reload_buckets", args=(buckets,))
            self._after_update(version)
        return {"seconds": time.perf_counter() - t0, "wait_seconds": t0 - waited, "tensors": counts[0],
                "bytes": sum(len(b) for b in buckets), "version": version}

    def _refuse_older(self, version: int, what: str) -> None:
        if version < self._version:
            raise ValueError(f"{self.name}.{what}: version {version} is older than the "
                             f"loaded version {self._version}")

    def _pause(self) -> None:
        """Stop the engine stepping with requests kept. An in-process engine steps only when
        called, and the turn already holds it; vLLM's own engine process steps on its own."""
        if self.partial_rollouts:
            self._llm.sleep(level=0, mode="keep")

    def _after_update(self, version: int) -> None:
        """New weights are in: drop every KV block the old weights computed, label the next tokens."""
        # Cached prompt blocks would make the new policy's logprobs silently wrong; requests in
        # flight (partial rollouts) are preempted and recomputed from their tokens so far.
        self._llm.reset_prefix_cache(reset_running_requests=self.partial_rollouts)
        self._set_version(version)
        if self.partial_rollouts:
            self._llm.wake_up(tags=["scheduling"])

    def _set_version(self, version: int) -> None:
        self._version = version
        self._llm.llm_engine.set_weight_version(str(version))

    # ---- NCCL transport (learner/nccl_sync.py drives these; learner.weight_sync="nccl" only)
    def _require_nccl(self, what: str) -> None:
        if self.weight_sync != "nccl":
            raise ValueError(f"{self.name}.{what}: this generator was started with weight_sync="
                             f"{self.weight_sync!r}; the learner's 'nccl' transport needs 'nccl' here too")

    def weight_transfer_gpus(self) -> list[str]:
        """UUID of the GPU of each vLLM worker, in worker-rank order (its length = NCCL ranks needed)."""
        self._require_nccl("weight_transfer_gpus")
        return [str(u) for u in self._llm.collective_rpc("tether_device_uuid")]

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the learner's NCCL group (blocks until every rank has joined).

        init_info: vLLM's NCCLWeightTransferInitInfo as a dict (master_address, master_port,
        rank_offset, world_size, packed, packed_buffer_size_bytes, packed_num_buffers).
        """
        self._require_nccl("init_weight_transfer")
        self._llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self, version: int) -> None:
        """Open an update round (vLLM: layerwise reload set up); refuses an older version.
        Holds the engine's turn until finish_weight_update (or a failure) releases it."""
        self._require_nccl("start_weight_update")
        self._refuse_older(version, "start_weight_update")
        self._turns.claim()
        try:
            self._pause()
            self._llm.start_weight_update()
        except BaseException:
            self._turns.release()
            raise

    def update_weights(self, update_info: dict) -> None:
        """Receive every tensor named in update_info (names, dtype_names, shapes) over NCCL,
        packed chunk by chunk, loading each into the model. Blocks until the broadcast ends."""
        try:
            self._llm.update_weights({"update_info": update_info})
        except BaseException:
            self._turns.release()
            raise

    def finish_weight_update(self, version: int) -> dict:
        """Close the round (vLLM: finalize layerwise reload), drop stale KV, record `version`."""
        t0 = time.perf_counter()
        try:
            self._llm.finish_weight_update()
            self._after_update(version)
        finally:
            self._turns.release()
        return {"seconds": time.perf_counter() - t0, "version": version}

    def shutdown_weight_transfer(self) -> None:
        """Leave the NCCL group; inference goes on."""
        if self.weight_sync == "nccl":
            self._llm.shutdown_weight_transfer_engine()

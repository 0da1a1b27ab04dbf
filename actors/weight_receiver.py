"""EngineWeights: the receiving side of weight updates for one generator's vLLM engine.

It owns the engine's policy version and implements the learner -> generator contract
(``core.infra.weights.WeightReceiver``) for every transport: "cpu" reloads safetensors buckets in
place through the worker extension (actors/vllm_extension.py); "nccl" and "ipc" forward to
the RLOfflineMixin methods of ``vllm.LLM`` (entrypoints/rl/offline.py), which fan out to the
workers with collective_rpc: only metadata (IPC: a memory handle) crosses Ray, the tensors
arrive over NCCL or through CUDA IPC.

Every update waits for the engine's turn (actors/engine_turns.py, shared with sampling): the
end of a generate call or, with partial rollouts, the end of the current engine step. New
weights drop every KV block the old ones computed and label the next tokens with the new version.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

from actors.engine_turns import EngineTurns
from core.choices import TRANSPORT_TABLE
from core.infra.weights import adapter_checksum

log = logging.getLogger(__name__)

ADAPTER_SLOT = 1  # the engine's one LoRA slot (vLLM ids start at 1); every version of the policy's adapter goes in it
ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names

# vLLM weight-transfer backends a generator takes (learner.weight_sync), with what they need CUDA for.
GPU_TRANSFER = {row.name: row.generator_cuda for row in TRANSPORT_TABLE if row.generator_cuda}


class EngineWeights:
    """The weights of one vLLM engine (``llm``): their version, and how new ones come in."""

    def __init__(self, *, llm, turns: EngineTurns, name: str, weight_sync: str = "cpu",
                 partial_rollouts: bool = False) -> None:
        self._llm, self._turns = llm, turns
        self.name, self.weight_sync, self.partial_rollouts = name, weight_sync, bool(partial_rollouts)
        self._round_open = False  # a GPU transfer round started and not finished: the engine is held
        self.adapter = None  # the LoRARequest every new request carries, once an adapter was pushed
        self._adapter_root: Path | None = None
        self._set_version(0)  # vLLM labels each token with it

    def version(self) -> int:
        return self._version

    def rewind(self, version: int) -> None:
        """A rollback to a checkpoint: the next weights pushed are that (older) version's."""
        self._close_open_round("a rollback")
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

    def load_adapter(self, version: int, files: dict[str, bytes]) -> dict:
        """Serve the base model plus the LoRA adapter in ``files`` as ``version`` (the contract:
        ``core.infra.weights.WeightReceiver.load_adapter``), and prove what the engine holds.

        Every version goes into the engine's one adapter slot, replaced in place, under the name
        ``policy-v<version>``: the name is part of vLLM's prefix-cache keys, so no cached block
        of one version serves another, and requests in flight (partial rollouts) go on under
        the new adapter exactly as they would under new full weights."""
        from vllm.lora.request import LoRARequest

        self._refuse_older(version, "load_adapter")
        waited = time.perf_counter()
        with self._turns.updating():
            t0 = time.perf_counter()
            path = self._write_adapter(version, files)
            name = f"policy-v{version}"
            self._pause()
            self._llm.llm_engine.add_lora(LoRARequest(name, ADAPTER_SLOT, str(path), load_inplace=True))
            config = json.loads(files[ADAPTER_CONFIG])
            report = self._llm.collective_rpc("tether_adapter_report", args=(
                ADAPTER_SLOT, files[ADAPTER_WEIGHTS], config["lora_alpha"] / config["r"]))[0]
            self.adapter = LoRARequest(name, ADAPTER_SLOT, str(path))  # loaded: requests never reload it
            self._after_update(version)
        return {"seconds": time.perf_counter() - t0, "wait_seconds": t0 - waited, "version": version,
                "checksum": adapter_checksum(files), "bytes": sum(map(len, files.values())), **report}

    def _write_adapter(self, version: int, files: dict[str, bytes]) -> Path:
        """The adapter's files in this generator's own folder (vLLM loads adapters by path); the
        previous version's folder goes once the new one is in place."""
        if self._adapter_root is None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix=f"tether-{self.name}-adapter-"))
        path = self._adapter_root / f"v{version}"
        shutil.rmtree(path, ignore_errors=True)  # a rollback pushes a version again
        path.mkdir(parents=True)
        for file, blob in files.items():
            (path / Path(file).name).write_bytes(blob)
        for old in self._adapter_root.iterdir():
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return path

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

    # ---- GPU transports (learner/transport/nccl.py, learner/transport/ipc.py drive these): vLLM's weight transfer
    def _require_transfer(self, what: str, transport: str | None = None) -> None:
        if self.weight_sync not in GPU_TRANSFER or transport not in (None, self.weight_sync):
            raise ValueError(f"{self.name}.{what}: this generator was started with weight_sync="
                             f"{self.weight_sync!r}; the learner's {transport or 'GPU'} transport needs "
                             f"weight_sync={transport or 'nccl or ipc'!r} here too")

    def weight_transfer_gpus(self, transport: str) -> list[str]:
        """UUID of the GPU of each vLLM worker, in worker-rank order (NCCL: one rank each;
        IPC: each must be the learner's GPU). ``transport``: the learner's, checked against ours."""
        self._require_transfer("weight_transfer_gpus", transport)
        return [str(u) for u in self._llm.collective_rpc("tether_device_uuid")]

    def init_weight_transfer(self, init_info: dict) -> None:
        """Join the learner's transfer group (NCCL: blocks until every rank has joined).

        init_info: vLLM's init info of this backend as a dict (NCCL: master_address, master_port,
        rank_offset, world_size and the packing; IPC: packed).
        """
        self._require_transfer("init_weight_transfer")
        self._llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self, version: int) -> None:
        """Open an update round (vLLM: layerwise reload set up); refuses an older version.
        Holds the engine's turn until finish_weight_update, or the round is given up, releases it."""
        self._require_transfer("start_weight_update")
        self._refuse_older(version, "start_weight_update")
        self._close_open_round("a new round starts")
        self._turns.claim()
        try:
            self._pause()
            self._llm.start_weight_update()
        except BaseException:
            self._turns.release()
            raise
        self._round_open = True

    def update_weights(self, update_info: dict) -> None:
        """Receive the tensors update_info names (names, dtype_names, shapes; IPC: the handle of
        one packed chunk) and load them. A failure leaves the round open, the engine held: until
        the learner gives the round up, the model's layers are half reloaded."""
        self._llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, version: int) -> dict:
        """Close the round (vLLM: finalize layerwise reload), drop stale KV, record `version`."""
        t0 = time.perf_counter()
        try:
            self._llm.finish_weight_update()
            self._after_update(version)
        finally:
            self._round_open = False
            self._turns.release()
        return {"seconds": time.perf_counter() - t0, "version": version}

    def shutdown_weight_transfer(self) -> None:
        """Leave the transfer group, giving up a round a failed push left open; inference goes on."""
        if self.weight_sync in GPU_TRANSFER:
            self._close_open_round("the learner left the group")
            self._llm.shutdown_weight_transfer_engine()

    def _close_open_round(self, why: str) -> None:
        """Give up a round whose finish never came. vLLM finalizes the reload with what arrived
        (a layer that got no tensor keeps its previous weights) or, if its receive failed and
        closed its side, with an empty round; the version stays, the next push replaces all."""
        if not self._round_open:
            return
        log.warning("%s: giving up a weight round a failed push left open (%s); the layers keep what arrived "
                    "until the next push", self.name, why)
        try:
            try:
                self._llm.finish_weight_update()
            # vLLM closed the round when the receive failed (layers still wait); its error comes as a
            # bare Exception from an engine in its own process, so no narrower type can be named
            except Exception:  # noqa: BLE001
                self._llm.start_weight_update()
                self._llm.finish_weight_update()
            self._after_update(self._version)
        finally:
            self._round_open = False
            self._turns.release()

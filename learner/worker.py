"""LearnerWorker: one DeepSpeed ZeRO rank, the facade Ray wraps (learner/group.py drives the ranks).

It owns the engine, the step counter and exactly one objective (learner/objectives/objective.py: PPO,
SFT or the reward model's), and composes the parts along their duties: the weights out
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
from typing import Callable, Optional

import torch
import torch.distributed as dist

from core.infra.threads import fit_threads, torch_threads
from core.infra.transfer import pull_args
from core.modeling.loading import pad_token_id
from learner import rendezvous
from learner.checkpoint import Checkpointer
from learner.collectives import Collectives
from learner.config import LearnerConfig, RankConfig
from learner.engine import build_engine
from learner.export import WeightExporter
from learner.lora import parameter_counts
from learner.objectives.objective import Objective
from learner.objectives.ppo import PPOObjective
from learner.transport.base import DEFAULT_BUCKET_BYTES

log = logging.getLogger(__name__)

TO_LEARNER = "transfer/to_learner"  # train()'s transfer/to_learner_{bytes,seconds,local_bytes}


class LearnerWorker:
    """One data-parallel rank. A plain class; cluster code wraps it with ray.remote.

    ``config``: a LearnerConfig or SupervisedConfig is taken as validated (the driver did it
    once); a dict goes through ``LearnerConfig.from_dict`` for this world size.
    ``objective``: the class of what this rank trains (learner/objectives/objective.py).
    """

    def __init__(self, *, rank: int, world_size: int, model: str, config: RankConfig | dict,
                 start: bool = True, objective: type[Objective] = PPOObjective) -> None:
        fit_threads()
        if not isinstance(config, RankConfig):
            config = LearnerConfig.from_dict({**config, "world_size": world_size})
        config.check_device(torch.cuda.is_available())
        self.config, self.rank, self.world_size, self.model_path = config, rank, world_size, str(model)
        self.objective_class = objective
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.backend: Optional[str] = None
        self._store = None  # rank 0: the store server; it must live as long as the group
        self.step = 0  # completed train() calls; checkpoints save it, PPO seeds its shuffle with it
        self.engine = None
        self.objective: Optional[Objective] = None
        self.exporter: Optional[WeightExporter] = None
        self.checkpoints: Optional[Checkpointer] = None
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
        """Load the objective's module into its DeepSpeed engine and wire the parts; returns health()."""
        if self.backend is None:
            raise RuntimeError(f"learner rank {self.rank}: build() before join()")
        self.engine = build_engine(self.model_path, self.config, self.world_size,
                                   load=self.objective_class.load_module)
        comm = Collectives(world_size=self.world_size,
                           device=self.device if self.backend == "nccl" else torch.device("cpu"))
        self.objective = self.objective_class(
            engine=self.engine, config=self.config, rank=self.rank, world_size=self.world_size, collectives=comm,
            device=self.device, pad_id=pad_token_id(None, self.engine.module.config, "Learner"))
        self.exporter = WeightExporter(engine=self.engine, config=self.config, rank=self.rank)
        self.checkpoints = Checkpointer(engine=self.engine, exporter=self.exporter, collectives=comm, rank=self.rank)
        return self.health()

    # ------------------------------------------------------------------ the objective

    def train(self, batch, **options) -> dict:
        """The objective's optimizer steps on this rank's share of the batch (for PPO: one update
        of ``ppo_epochs`` passes, with ``ptx_rows`` and ``kl``, the step's core.kl.KLPenalty);
        every rank must call it. A batch in a core.infra.transfer.Pull is pulled here: what that
        moved between nodes comes back as ``transfer/to_learner_*`` (0 for a plain list)."""
        (batch,), moved = pull_args(batch)
        metrics = self.objective.train(batch, step=self.step, **options)
        self.step += 1
        return {**metrics, **moved.as_metrics(TO_LEARNER)}

    def evaluate(self, batch, **options):
        """The objective's evaluation of this rank's share (PPO: the responses' log-probs under
        the current weights; SFT, reward model: the held-out loss); every rank must call it."""
        return self.objective.evaluate(batch, **options)

    def reference_logprobs_pulled(self, rollouts) -> tuple:
        """The reference's log-probs of rollouts this call pulls itself (num_returns=2; the
        reference pool's call, actors.reference.Reference): the policy with its LoRA adapter
        off (``reference.on_learner``), and what the pull moved between nodes. Rank 0 alone."""
        (rollouts,), moved = pull_args(rollouts)
        with torch_threads(getattr(self.config, "reference_threads", 0)):
            return self.objective.reference_logprobs(rollouts), moved

    def apply(self, call: Callable, batch):
        """``call(objective, batch)``: a call of this objective's own (the reward model's
        scores), passed as the function itself; every rank must call it."""
        return call(self.objective, batch)

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
        return self.checkpoints.save(out_dir, step=self.step)

    def load(self, in_dir) -> int:
        self.step = self.checkpoints.load(in_dir)  # reseeds PPO's shuffle as the saved run had it
        return self.step

    def save_pretrained_policy(self, out_dir) -> Optional[str]:
        return self.checkpoints.save_pretrained_policy(out_dir)

    def health(self) -> dict:
        """Cheap: no collective, no tensor."""
        built = self.engine is not None
        return {"rank": self.rank, "pid": os.getpid(), "world_size": self.world_size, "ok": True, "built": built,
                "step": self.step, "optimizer_steps": int(self.engine.global_steps) if built else 0,
                "zero_stage": self.config.zero_stage, "backend": self.backend, "device": str(self.device),
                "model": self.model_path, "objective": self.objective_class.name,
                **(self._dtypes() if built else {}), **(self._parameters() if built else {})}

    def _parameters(self) -> dict:
        """What trains: the parameter counts (full sizes under ZeRO-3), the adapter rank (0: none)
        and whether a separate critic's body trains as an adapter too."""
        trainable, total = parameter_counts(self.engine.module)
        lora = getattr(self.engine.module, "lora", None)
        return {"trainable_parameters": trainable, "parameters": total, "lora_rank": lora.rank if lora else 0,
                "lora_critic": getattr(self.engine.module, "critic_lora", None) is not None}

    def _dtypes(self) -> dict:
        """The dtype the model computes in, and the optimizer's (DeepSpeed bf16 keeps fp32
        master weights: its wrapped torch optimizer steps those, not the bf16 module's)."""
        engine = self.engine
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
        # ZeRO-3 hands its torch optimizer the flat fp32 partitions only inside step()
        master = next((p for g in inner.param_groups for p in g["params"]), None)
        if master is None:
            master = engine.optimizer.fp32_partitioned_groups_flat[0]
        name = lambda t: str(t.dtype).removeprefix("torch.")  # noqa: E731
        return {"dtype": name(next(engine.module.parameters())), "master_dtype": name(master)}

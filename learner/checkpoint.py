"""Resumable learner state on disk: a DeepSpeed checkpoint plus the policy in HF format."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from learner import lora as adapters
from learner.collectives import Collectives
from learner.export import WeightExporter

DS_DIR, POLICY_DIR = "deepspeed", "policy"


class Checkpointer:
    """Save / load of one rank's share (ZeRO partitions, optimizer, scheduler); all ranks call."""

    def __init__(self, *, engine, exporter: WeightExporter, collectives: Collectives, rank: int) -> None:
        self.engine, self.exporter, self.comm, self.rank = engine, exporter, collectives, rank

    def save(self, out_dir, *, step: int) -> str:
        """The full resumable state under out_dir/deepspeed, the HF policy under out_dir/policy."""
        out = Path(out_dir)
        # With a LoRA adapter the frozen base (and an adapted critic's) is left out: it is the model
        # the run started from, which a resume loads again before these weights.
        with adapters.frozen_state_left_out(self.engine.module) if self.lora else contextlib.nullcontext():
            self.engine.save_checkpoint(str(out / DS_DIR), tag=f"step{step}", client_state={"tether_step": step},
                                        exclude_frozen_parameters=self.lora)
        self.save_pretrained_policy(out / POLICY_DIR, with_lm=not self.lora)
        self.comm.barrier()  # the directory is complete when any rank returns
        return str(out)

    def load(self, in_dir) -> int:
        """Restore model, optimizer and scheduler from ``save``; returns the saved step."""
        path, client = self.engine.load_checkpoint(str(Path(in_dir) / DS_DIR), load_module_strict=not self.lora)
        if path is None:
            raise FileNotFoundError(f"learner.load: no DeepSpeed checkpoint under {Path(in_dir) / DS_DIR}")
        return int(client.get("tether_step", 0))

    @property
    def lora(self) -> bool:
        return self.exporter.lora is not None

    def save_pretrained_policy(self, out_dir, *, with_lm: bool = True) -> Optional[str]:
        """The policy (LM, value head, critic) in HF format, written by rank 0; with a LoRA adapter
        the LM merged, and the adapter alone under adapter/ (``with_lm=False``: the adapter only)."""
        state = self.exporter.full_state_dict(trainable_only=self.lora and not with_lm)
        if self.rank != 0:
            return None
        return str(self.engine.module.save_pretrained(out_dir, state_dict=state, with_lm=with_lm))

"""Resumable learner state on disk: a DeepSpeed checkpoint plus the policy in HF format."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

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
        self.engine.save_checkpoint(str(out / DS_DIR), tag=f"step{step}", client_state={"tether_step": step})
        self.save_pretrained_policy(out / POLICY_DIR)
        self.comm.barrier()  # the directory is complete when any rank returns
        return str(out)

    def load(self, in_dir) -> int:
        """Restore model, optimizer and scheduler from ``save``; returns the saved step."""
        path, client = self.engine.load_checkpoint(str(Path(in_dir) / DS_DIR))
        if path is None:
            raise FileNotFoundError(f"learner.load: no DeepSpeed checkpoint under {Path(in_dir) / DS_DIR}")
        return int(client.get("tether_step", 0))

    def save_pretrained_policy(self, out_dir) -> Optional[str]:
        """The policy (LM, value head, critic) in HF format, written by rank 0."""
        state = self.exporter.full_state_dict()
        if self.rank != 0:
            return None
        return str(self.engine.module.save_pretrained(out_dir, state_dict=state))

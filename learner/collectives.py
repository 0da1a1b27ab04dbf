"""All-reduces of a few scalars across the learner ranks (counts, sums, maxima for metrics), and
the all-gather of a few numbers per rollout (the group estimators' scores)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class Collectives:
    """Float64 all-reduces over the default process group; plain values with one rank."""

    def __init__(self, *, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device  # NCCL reduces on the GPU; gloo on the CPU

    def sum(self, values: Sequence) -> list[float]:
        """Sums over the ranks, in order. Also the ``reduce=`` of core.masked's whiten and
        explained_variance, which then see the global batch."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def gather_rows(self, rows: Sequence[Sequence[float]]) -> list[list[float]]:
        """Every rank's ``rows`` [n_r, k] (n_r >= 1 may differ between ranks, k may not), rank 0's
        first: [sum of n_r, k]."""
        t = torch.tensor([[float(v) for v in row] for row in rows], dtype=torch.float64, device=self.device)
        if self.world_size == 1:
            return t.tolist()
        n = torch.tensor([len(t)], dtype=torch.int64, device=self.device)
        counts = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(counts, n)
        counts = [int(c) for c in counts]
        padded = torch.zeros((max(counts), t.shape[1]), dtype=t.dtype, device=self.device)
        padded[:len(t)] = t
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)  # all_gather wants one shape: every rank sends max(n_r) rows
        return torch.cat([p[:c] for p, c in zip(parts, counts)]).tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _reduce(self, values: Sequence, op) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.tolist()

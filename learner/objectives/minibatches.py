"""Which rows each rank trains in each minibatch, when ranks hold unequal shards.

Every rank computes the same plan from the shard sizes alone: the global batch is the
shards in rank order (N rows), one visiting order over it (a permutation, or the identity
without shuffling) is cut into minibatches of M rows, and each rank trains its own rows of
each. DeepSpeed needs the same sequence of backward and step calls on every rank, so every
rank runs the same number of micro-batches in a minibatch: the most any rank needs. The
update is then one process's over the global batch, whatever the world size.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def visit_order(n: int, *, seed: int, step: int, epoch: int, shuffle: bool) -> np.ndarray:
    """[n] int64 global row positions in the order an epoch visits them. Seeded by
    (seed, step, epoch) alone, so every rank draws the same one and a resumed run replays it."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, step, epoch]).permutation(n)


def minibatch_plan(counts: list[int], rank: int, order: np.ndarray, minibatch_size: int,
                   micro_batch_size: int) -> list[tuple[np.ndarray, int]]:
    """Per minibatch: (this rank's local row indices [m_r], micro-batches every rank runs).

    ``counts`` [W]: rows on each rank; rank r holds global rows sum(counts[:r]) onward.
    ``order`` [N]: visit_order over N = sum(counts); minibatch k is order[k*M:(k+1)*M].
    Local indices keep the visiting order; a rank may have none in a minibatch.
    """
    starts = np.concatenate([[0], np.cumsum(counts)])
    owner = np.searchsorted(starts, order, side="right") - 1  # [N] the rank holding each row
    plan = []
    for lo in range(0, len(order), minibatch_size):
        rows, who = order[lo:lo + minibatch_size], owner[lo:lo + minibatch_size]
        most = int(np.bincount(who, minlength=len(counts)).max())
        micros = -(-most // micro_batch_size)
        plan.append((rows[who == rank] - starts[rank], micros))
    return plan


def split_rows(rows: Optional[np.ndarray], world_size: int) -> list:
    """[N, T] -> W blocks of [N/W, T] (None -> W Nones): each rank's share of the PTX rows."""
    if rows is None:
        return [None] * world_size
    rows = np.asarray(rows)
    if rows.ndim != 2 or len(rows) == 0 or len(rows) % world_size:
        raise ValueError(f"learner.train: ptx_rows must be a 2-D [N, T] array with N a positive multiple "
                         f"of the {world_size} ranks, got shape {rows.shape}")
    return np.split(rows, world_size)

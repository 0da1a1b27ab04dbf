"""The run's prompt stream: batches drawn in a fixed order, each opened as ledger chunks."""
from __future__ import annotations

import itertools
import threading


class PromptStream:
    """Draws ``prompts_per_step`` prompts at a time from ``dataset`` (cluster.data.prompts.PromptDataset),
    epoch after epoch, and opens each batch as chunks of ``rollouts`` (the ChunkDispatcher).

    The stream is deterministic, so a position (batches drawn so far) is all a checkpoint keeps."""

    def __init__(self, *, dataset, prompts_per_step: int, rollouts) -> None:
        self._dataset, self._per_step, self._rollouts = dataset, prompts_per_step, rollouts
        # Drawing a batch and opening its ledger chunks is one act, so a checkpoint's data
        # position and its unfinished prompts agree (async mode draws in another thread).
        self._lock = threading.Lock()
        self.seek(0)

    def seek(self, batches_issued: int) -> None:
        """Position the stream after ``batches_issued`` batches."""
        stream = self._dataset.batches(self._per_step, epochs=None)
        self._prompts = itertools.islice(stream, batches_issued, None)
        self.batches_issued = batches_issued

    def issue(self) -> list:
        """The next batch of prompts, as ledger chunks."""
        with self._lock:
            indices, prompt_ids, _ = next(self._prompts)
            self.batches_issued += 1
            return self._rollouts.open(indices, prompt_ids)

    def position(self) -> tuple[int, tuple]:
        """Batches drawn so far and the prompts drawn but not yet trained on, as of one moment."""
        with self._lock:
            return self.batches_issued, tuple(self._rollouts.ledger.unfinished_prompts())

"""TensorBoard: event files in the run folder's tensorboard/ (torch's SummaryWriter)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from cluster.runtime.observe.trackers.base import Tracker

FOLDER = "tensorboard"


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """TensorBoard's text tab renders markdown: a table of the samples."""
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


class TensorBoardTracker(Tracker):
    """One writer on ``<run folder>/tensorboard``; a resumed run adds an event file to it."""

    name = package = "tensorboard"

    def start(self, resume_id: Optional[str]) -> str:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.run.run_dir / FOLDER))
        return resume_id or str(self.run.run_dir / FOLDER)

    def params(self, config: dict) -> None:
        self.writer.add_text("config", markdown_table(["key", "value"], [[k, v] for k, v in config.items()]), 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text("samples", markdown_table(columns, rows), step)

    def plots(self, step: int, paths: dict[str, Path]) -> None:
        from matplotlib.image import imread

        for name, path in paths.items():
            self.writer.add_image(f"plots/{name}", imread(path)[..., :3], step, dataformats="HWC")

    def finish(self, status: str, checkpoint: Optional[str]) -> None:
        self.writer.add_text("status", status)
        if checkpoint:
            self.writer.add_text("checkpoint", checkpoint)
        self.writer.close()

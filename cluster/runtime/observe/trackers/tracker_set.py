"""The run's trackers as one: every row, table, plot and the end status fanned out to each backend.

A backend that fails at start-up stops the job with one line (a UserError naming it and the fix);
one that fails mid-run is warned about once and dropped, and training goes on. ``trackers.json``
in the run folder keeps each backend's run id and the last step it got: a resumed run reattaches
to the same tracker run and skips the steps that run already has (a resume redoes the steps
after its checkpoint; the trackers keep the values they got first), so no step arrives twice.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Optional

from cluster.job.errors import Stopped, UserError
from cluster.runtime.observe.trackers.base import Tracker
from core.infra.errors import type_and_first_line
from core.infra.files import write_atomic

log = logging.getLogger("tether")
STATE_FILE = "trackers.json"


class TrackerSet:
    """The started backends by name; empty when the run names none."""

    def __init__(self, run_dir: Path, state: Optional[dict] = None) -> None:
        self.run_dir, self._state = Path(run_dir), state if state is not None else {}
        self._live: dict[str, Tracker] = {}
        self._floor: dict[str, int] = {}  # steps at or below it are skipped: that tracker run has them
        self.finished = False

    @classmethod
    def start(cls, run_dir: Path, backends: dict[str, Tracker]) -> "TrackerSet":
        """Start (or, with an id in trackers.json, reattach) every backend; a new tracker run gets the config."""
        path = Path(run_dir) / STATE_FILE
        started = cls(run_dir, json.loads(path.read_text()) if path.exists() else {})
        for name, backend in backends.items():
            prior = started._state.get(name, {})
            try:
                started._state[name] = {"id": backend.start(prior.get("id")), "last_step": prior.get("last_step", -1)}
                started._live[name], started._floor[name] = backend, started._state[name]["last_step"]
                if not prior.get("id"):
                    backend.params(backend.run.config)
            except Exception as e:  # noqa: BLE001 - any failure to start is the user's setting or service to fix
                started.finish("failed")
                raise UserError(f"run.trackers: {name} did not start ({type_and_first_line(e)}); "
                                f"{backend.fix()}") from None
        if backends:
            started._save()
        return started

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._live)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One row of numbers at ``step`` (the row metrics.jsonl got, its finite numbers)."""
        self._each(step, lambda b: b.log(step, metrics))

    def samples(self, step: int, rows: list[dict]) -> None:
        if not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        table = [[_cell(row.get(c)) for c in columns] for row in rows]
        self._each(step, lambda b: b.samples(step, columns, table))

    def rewind(self) -> None:
        """The run goes back to an earlier step: the steps the trackers have are not sent again."""
        self._floor = {name: self._state[name]["last_step"] for name in self._live}

    def finish(self, status: str, *, checkpoint: Optional[str] = None, plots: Optional[dict] = None) -> None:
        """The end: the plots at the last step, the checkpoint's path and the status; once."""
        if self.finished:
            return
        self.finished = True
        for name in list(self._live):
            step = max(self._state[name]["last_step"], 0)
            if plots:
                self._call(name, lambda b, at=step: b.plots(at, plots))
            self._call(name, lambda b: b.finish(status, checkpoint))

    def __enter__(self) -> "TrackerSet":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish("stopped" if exc_type is Stopped else "failed" if exc_type else "finished")

    def _each(self, step: int, call: Callable[[Tracker], None]) -> None:
        sent = False
        for name in list(self._live):
            if step > self._floor[name] and self._call(name, call):
                self._state[name]["last_step"] = max(self._state[name]["last_step"], step)
                sent = True
        if sent:
            self._save()

    def _call(self, name: str, call: Callable[[Tracker], None]) -> bool:
        """``call`` on backend ``name``; a failure drops it for the rest of the run, with one warning."""
        backend = self._live.get(name)
        if backend is None:
            return False
        try:
            call(backend)
            return True
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            del self._live[name]
            log.warning("tracker %s failed (%s); it gets nothing more from this run, training goes on",
                        name, type_and_first_line(e))
            return False

    def _save(self) -> None:
        write_atomic(self.run_dir / STATE_FILE, json.dumps(self._state, indent=1))


def _cell(value):
    """A table cell is a scalar: a row's nested fields (its prompt's other columns) as JSON text."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)

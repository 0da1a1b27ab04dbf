"""What a run's console shows: tether's own lines. The libraries' go to files, by source.

Unless run.library_logs is true:

* In the driver, the console handlers pass tether's records (loggers ``tether``,
  ``cluster.*``, ``actors.*``, ``learner.*``, ``core.*``) and any library's errors. The
  libraries' other records (Ray, Hugging Face, matplotlib, ...) and Python warnings go to
  the run folder's ``library.log``; those from before the folder exists are held until it does.
* The actors' console output (vLLM, DeepSpeed and torch: their log lines, warnings and
  progress bars) stays in Ray's worker logs (``<session>/logs/worker-*.out|err``): Ray does
  not forward it to the driver (cluster/job/startup.py ``connect_ray``). What an actor has to
  tell the user reaches the console through the driver, in tether's words: a reward's
  errors, a replica that died, prompts skipped as too long for the model.
* Ray's banners for a worker that died ("A worker died or was killed ...", many lines of ids
  and likely causes) and for a node marked dead ("The node with node id ... has been marked
  dead because the detector has missed too many heartbeats", and "Raylet is terminated ..."
  with its log's last lines when a partitioned node returns) go to ``library.log`` too:
  tether's own line names the replica or node and what happens to its work. Ray's other
  messages from its raylet still reach the console.

The start-up prints where both are (``library logs: ...``).
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Optional

TETHER_LOGGERS = ("tether", "cluster", "actors", "learner", "core")
LIBRARY_LOG = "library.log"
WORKER_DIED = "A worker died or was killed"
NODE_DIED = "has been marked dead"  # "The node with node id ... has been marked dead because the detector ..."
# A node cut off the network that comes back: its raylet exits, and Ray reports it with the
# last 20 lines of that raylet's log ("Raylet is terminated. Termination is unexpected. ...").
RAYLET_DIED = "Raylet is terminated"
DEATH_BANNERS = (WORKER_DIED, NODE_DIED, RAYLET_DIED)


def is_tethers(record: logging.LogRecord) -> bool:
    return record.name.split(".", 1)[0] in TETHER_LOGGERS


class ConsoleFilter(logging.Filter):
    """On a console handler: tether's records, and everyone's errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_tethers(record) or record.levelno >= logging.ERROR


class LibraryLog(logging.Handler):
    """The libraries' records, appended to the run folder's library.log once open() names the
    folder; until then held in memory (at most ``hold`` of them)."""

    def __init__(self, hold: int = 10_000) -> None:
        super().__init__()
        self.addFilter(lambda record: not is_tethers(record))
        # Its own format: Ray's set-up re-formats every handler of the "ray" logger, this one too.
        self._format = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._held: list = []
        self._hold, self._file, self.path = hold, None, None

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is None:
            if len(self._held) < self._hold:
                self._held.append(record)
            return
        try:
            self._file.write(self.format(record) + "\n")
            self._file.flush()
        except Exception:  # noqa: BLE001 - logging must not fail the run
            self.handleError(record)

    def format(self, record: logging.LogRecord) -> str:
        return self._format.format(record)

    def open(self, run_dir: Path) -> None:
        with self.lock:
            self.path = Path(run_dir) / LIBRARY_LOG
            self._file = open(self.path, "a", encoding="utf-8")
            held, self._held = self._held, []
        for record in held:
            self.emit(record)

    def where(self, ray_logs: Optional[Path]) -> str:
        actors = f", the actors' in Ray's worker logs under {ray_logs}" if ray_logs else ""
        return f"library logs: {self.path}{actors} (run.library_logs=true shows them here)"

    def close(self) -> None:
        with self.lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        super().close()


def _console_loggers() -> list[logging.Logger]:
    """The root logger and the libraries' loggers that print on their own (no propagation)."""
    found = [logging.getLogger()]
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and logger.handlers and not logger.propagate:
            found.append(logger)
    return found


# Ray releases whose driver-side printer the banner's rerouting was tested against (below).
BANNER_REROUTE_TESTED = ("2.60.",)


@contextlib.contextmanager
def death_banners_to_log():
    """While inside, Ray's banners for a dead worker or node are records of the ``ray.raylet`` logger.

    Ray's driver prints its raylet's error messages to stdout itself, from a thread of its own
    (``listen_error_messages`` calls the module's ``print_to_stdstream`` for each), not
    through logging, so no logging filter reaches them, and Ray has no switch for them: the
    printer is wrapped instead. That reaches into Ray's internals, so only on the releases
    it was tested on; on another the banner stays on the console (one log line says why).
    """
    import ray
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or not ray.__version__.startswith(BANNER_REROUTE_TESTED):
        logging.getLogger(__name__).info(
            "Ray %s: its worker and node death banners stay on the console (rerouting tested on %s)",
            ray.__version__, ", ".join(BANNER_REROUTE_TESTED))
        yield
        return
    banner_log = logging.getLogger("ray.raylet")

    def print_or_log(data: dict, ignore_prefix: bool) -> None:
        lines = data.get("lines") or ()
        if data.get("pid") == "raylet" and any(b in line for line in lines for b in DEATH_BANNERS):
            for line in lines:
                banner_log.warning("%s", line)
            return
        printer(data, ignore_prefix)

    ray_worker.print_to_stdstream = print_or_log
    try:
        yield
    finally:
        ray_worker.print_to_stdstream = printer


@contextlib.contextmanager
def quiet_console(library_logs: bool):
    """While inside, the console shows tether's own lines (module docstring); yields the
    LibraryLog to open() once the run folder exists (None when run.library_logs is true)."""
    if library_logs:
        yield None
        return
    from cluster.runtime.pools.pool import quiet_libraries

    quiet_libraries()
    library, console = LibraryLog(), ConsoleFilter()
    loggers = _console_loggers()
    # The console handlers: basicConfig's on the root, the libraries' own (Ray's, Hugging
    # Face's); a test harness's handlers (subclasses with their own streams) are left alone.
    handlers = [h for lg in loggers for h in lg.handlers
                if type(h) is logging.StreamHandler or (lg.name != "root" and isinstance(h, logging.StreamHandler))]
    for h in handlers:
        h.addFilter(console)
    for lg in loggers:
        lg.addHandler(library)
    logging.captureWarnings(True)
    try:
        with death_banners_to_log():
            yield library
    finally:
        logging.captureWarnings(False)
        for lg in loggers:
            lg.removeHandler(library)
        for h in handlers:
            h.removeFilter(console)
        library.close()

"""A job's run folder: config.yaml, status.json (written whole, never half) and error.log,
and ``running``, the status a run moves through."""
from __future__ import annotations

import json
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from cluster.job.errors import ERROR_LOG, Stopped, UserError
from core.infra.errors import one_line
from core.infra.files import write_atomic


def make_run_dir(cfg) -> Path:
    name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir) / name
    if (run_dir / "status.json").exists():
        raise UserError(f"run folder {run_dir} already holds a run; choose another run.name")
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    except OSError as e:
        raise UserError(f"cannot create run folder {run_dir} ({e.strerror}); set run.dir to a "
                        "writable directory") from None
    return run_dir


def write_status(run_dir: Path, state: str, **extra) -> None:
    write_atomic(run_dir / "status.json", json.dumps({"state": state, "time": time.time(), **extra}, default=float))


@contextmanager
def running(run_dir: Path, *, failed: Optional[dict] = None,
            interrupted: Optional[Callable[[], dict]] = None, **status) -> Iterator[None]:
    """status.json ``running`` (with ``status``) now; if the block raises, the traceback in
    error.log and status ``failed`` with ``failed``'s fields (read then) and the one-line reason,
    and the error goes on; a Stopped of this run has written its own status (of a run inside
    this one, e.g. a pipeline's stage, it fails this one). ``interrupted``: a KeyboardInterrupt
    (a second signal) is status ``stopped`` with its fields instead. The block writes
    ``succeeded`` itself: only it knows the result's fields."""
    write_status(run_dir, "running", **status)
    try:
        yield
    except Stopped as e:
        if e.run_dir != run_dir:
            _failed(run_dir, e, failed)
        raise
    except BaseException as e:
        if interrupted is not None and isinstance(e, KeyboardInterrupt):
            _error_log(run_dir, e)
            write_status(run_dir, "stopped", **interrupted())
        else:
            _failed(run_dir, e, failed)
        raise


def _error_log(run_dir: Path, e: BaseException) -> None:
    path = run_dir / ERROR_LOG
    path.write_text("".join(traceback.format_exception(e)))
    try:  # where the job's last line sends the reader (cluster.job.errors.exit_status)
        e.error_log = path
    except AttributeError:  # an exception type that takes no attributes: its line says "above"
        pass


def _failed(run_dir: Path, e: BaseException, fields: Optional[dict]) -> None:
    _error_log(run_dir, e)
    write_status(run_dir, "failed", **(fields or {}), reason=one_line(e))

"""How a tether job ends: the stop, the exit codes and the one line on stderr. ``exit_status``
is the one place that decides which error ends in which code: a UserError (core/infra/errors.py, the
root of every user mistake) 2, a stop its signal's, anything else 1."""
from __future__ import annotations

import signal
import sys
import traceback
from pathlib import Path

from core.infra.errors import UserError, one_line

EXIT_DONE = 0
EXIT_FAILED = 1        # the run failed; the traceback is in the run folder's error.log
EXIT_USER_ERROR = 2    # a mistake in the command, config, data or cluster request


def signal_exit_code(signum: int) -> int:
    """What a shell reports for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


EXIT_INTERRUPTED = signal_exit_code(signal.SIGINT)  # Ctrl-C before the run's own signal handling


class Stopped(Exception):
    """The run in ``run_dir`` stopped on SIGTERM/SIGINT (its status.json says whether it can be resumed)."""

    def __init__(self, message: str, exit_code: int, *, run_dir: Path) -> None:
        super().__init__(message)
        self.exit_code, self.run_dir = exit_code, run_dir


def report(line: str, exit_code: int) -> int:
    """``tether: <line>`` on stderr; returns ``exit_code`` for the caller to exit with."""
    print(f"tether: {line}", file=sys.stderr)
    return exit_code


def user_error(message: str) -> int:
    """A user mistake: ``tether: error: <message>`` on stderr, exit code 2."""
    return report(f"error: {message}", EXIT_USER_ERROR)


ERROR_LOG = "error.log"  # in the run folder: the traceback of a failed run (cluster/job/folder.py)


def exit_status(e: BaseException) -> tuple[int, str]:
    """(exit code, the line after ``tether: ``) of a job that ``e`` ended."""
    if isinstance(e, Stopped):
        return e.exit_code, str(e)
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(e, UserError):
        return EXIT_USER_ERROR, f"error: {one_line(e)}"
    where = getattr(e, "error_log", None)
    return EXIT_FAILED, f"run failed: {one_line(e)} (traceback {f'in {where}' if where else 'above'})"


def report_error(e: BaseException) -> int:
    """The job's last line on stderr for ``e``; returns its exit code. A failure that no run
    folder recorded (it came before the folder was made) shows its traceback here."""
    code, line = exit_status(e)
    if code == EXIT_FAILED and getattr(e, "error_log", None) is None:
        traceback.print_exception(e, file=sys.stderr)
    return report(line, code)

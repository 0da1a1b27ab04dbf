"""How a tether job ends: the user-error type, the stop, the exit codes and the one line on stderr."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

EXIT_DONE = 0
EXIT_FAILED = 1        # the run failed; the traceback is in the run folder's error.log
EXIT_USER_ERROR = 2    # a mistake in the command, config, data or cluster request


def signal_exit_code(signum: int) -> int:
    """What a shell reports for a process ended by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


EXIT_INTERRUPTED = signal_exit_code(signal.SIGINT)  # Ctrl-C before the run's own signal handling


class UserError(Exception):
    """Bad config, data or cluster request: reported as one line, exit code 2."""


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

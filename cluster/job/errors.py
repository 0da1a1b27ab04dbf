"""How a tether job fails: the user-error type, the one-line message and the exit codes."""
from __future__ import annotations


class UserError(Exception):
    """Bad config, data or cluster request: reported as one line, exit code 2."""


class Stopped(Exception):
    """The run stopped on SIGTERM/SIGINT (status.json says whether it can be resumed)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def one_line(e: BaseException) -> str:
    """The last meaningful line of an error, including errors raised inside Ray actors."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error:" in ln or "Error(" in ln:
            return ln
    return lines[-1] if lines else type(e).__name__

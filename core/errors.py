"""Errors in one line: the line a job ends with, and ``Type: first line`` for log lines and
the messages of errors that wrap another."""
from __future__ import annotations


def one_line(e: BaseException) -> str:
    """The last meaningful line of an error, including errors raised inside Ray actors (whose
    text is the remote traceback, the error itself last)."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error:" in ln or "Error(" in ln:
            return ln
    return lines[-1] if lines else type(e).__name__


def type_and_first_line(e: BaseException) -> str:
    """``Type: first line of the message`` (``Type`` alone when there is no message)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__

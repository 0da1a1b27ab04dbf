"""The user's mistakes and errors in one line.

``UserError`` is the root of every mistake of the user's (a config key, a data file, a model, a
checkpoint, a command line, a cluster request): a job reports one as one line and exit code 2
(cluster/job/errors.py decides every exit code). Any other error is a failure of tether's: exit
1 and its traceback. So a check on user input raises a UserError subclass, and where a library
says "bad input" with a plain ValueError, ``user_input`` turns it into one at that call.

``one_line`` gives the line a job ends with, ``type_and_first_line`` the ``Type: first line``
of log lines and of the messages of errors that wrap another.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class UserError(Exception):
    """A mistake of the user's: reported as one line, exit code 2."""


class InputError(UserError, ValueError):
    """A value the user gave that tether refuses. A ValueError too, as such errors always were:
    code that validates by catching ValueError sees it unchanged."""


@contextmanager
def user_input(prefix: str = "", kinds: tuple[type[BaseException], ...] = (ValueError, OSError)) -> Iterator[None]:
    """Around one call that reads the user's input (a tokenizer, a dataset, a reward function):
    the ``kinds`` it raises are that input's fault, reported as an InputError (``prefix`` then
    its one line). Only around such a call: a ValueError anywhere else is tether's own bug."""
    try:
        yield
    except UserError:
        raise
    except kinds as e:
        raise InputError(f"{prefix}{one_line(e)}") from None


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

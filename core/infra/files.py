"""Writes that readers never see half done: a file written whole, a directory published by rename."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Union


def write_atomic(path: Union[str, Path], data: Union[str, bytes], *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (str as UTF-8) whole or not at all: a temp file beside
    it, then a rename. ``mode``: mkstemp makes files 0600, and run files are for everyone
    who can read the run."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def publish_dir(final: Union[str, Path], *, shared: bool = False) -> Iterator[Path]:
    """An empty directory to fill, renamed to ``final`` once the block completes.

    One writer (the default): the leftover of a crashed write is cleared first and an
    existing ``final`` is replaced (a rerun writes the same name again). ``shared``, for a
    cache that several processes may build at once: each builds in a directory of its own,
    the first rename wins and an existing ``final`` is kept, since the builds are identical.
    """
    final = Path(final)
    if not shared:
        tmp = final.with_name(f".{final.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        yield tmp
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def held_lock(path: Union[str, Path]) -> Iterator[None]:
    """An exclusive lock on the file ``path`` (made if missing) for the block; another process
    asking for it waits. The kernel drops it when its holder dies, so a crash leaves none held."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

"""Worker processes for user code: a fresh interpreter that talks over a socket pair.

Each worker is a fresh interpreter (``sys.executable``), never a fork of the replica (a Ray
actor has threads; a forked copy of a held lock deadlocks): what multiprocessing's ``spawn``
does, without its re-run of the parent's ``__main__`` (in a Ray actor, Ray's worker script; in
a user's script, maybe code without a main guard that would start a run). It gets the
replica's sys.path, so what the replica imports, it imports; it talks over a socket pair with
multiprocessing's Connection. Each watches its parent and exits when it is gone, so a replica
that dies leaves no worker behind. core/infra/worker_pool.py keeps a pool of them; the reward
sandbox (actors/rewards/sandbox.py) and the environment workers (actors/environments/workers.py) run on it.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable


def _watch_parent(parent: int) -> None:
    """Exit when the replica that started this worker is gone (its pid no longer our parent)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def worker_setup(parent: int, memory_mb: int) -> None:
    """What every worker does first: leave with its parent, ignore Ctrl-C (the replica's to
    handle), and cap its data segment at ``memory_mb`` MiB (0: no cap; RLIMIT_DATA counts the
    heap and anonymous mappings, not address space libraries reserve without using it)."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if memory_mb:
        limit = int(memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


# What an import that ran out of a worker's address space says: Python's MemoryError, or a C
# extension's allocation failure that surfaces as something else.
OUT_OF_MEMORY = ("MemoryError", "error return without exception set", "failed to map segment", "Cannot allocate memory",
                 "bad_alloc", "pthread_create")


def import_failure(text: str, memory_mb: int, setting: str) -> str:
    """An import's failure line, with a hint naming ``setting`` when the worker's memory cap
    (``memory_mb`` MiB) is the likely cause."""
    if memory_mb and any(marker in text for marker in OUT_OF_MEMORY):
        return f"{text} (likely out of memory within {setting}={memory_mb}, which counts the interpreter too: raise it)"
    return text


def serve(conn: Connection, load: Callable[[], Callable[[Any], Any]], *, what: str, memory_mb: int, setting: str,
          parent: int, unsendable: Callable[[Any, Exception], Any] | None = None) -> None:
    """A worker's life, the other side of core/infra/worker_pool.py: ``worker_setup``, then
    ``load()`` imports the user's code (``what``, named in its errors) once and gives the function
    that answers a request. The first message says ("ready", None), or ("error", one line) and the
    worker exits; then each request gets its answer until a None (stop) or the replica's socket
    closes. An answer that cannot be sent is replaced by ``unsendable(request, error)``; without
    one, the worker dies of it (and the pool reports that)."""
    worker_setup(parent, memory_mb)
    try:
        answer = load()
    except (ValueError, MemoryError) as e:
        why = str(e) if isinstance(e, ValueError) else f"{what}: MemoryError while importing it"
        text = import_failure(why, memory_mb, setting)
        try:
            conn.send(("error", text))
        except MemoryError:  # the parent reports the exit, naming memory_mb
            pass
        os._exit(1)
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        reply = answer(request)
        try:
            conn.send(reply)
        except Exception as e:
            if unsendable is None:
                raise
            conn.send(unsendable(request, e))


def entry_args() -> tuple[Connection, list]:
    """In a worker started by ``spawn``: (its connection, the arguments it was given)."""
    fd, *args = json.loads(sys.argv[1])
    return Connection(fd), args


def spawn(entry: str, args: list) -> tuple[subprocess.Popen, Connection]:
    """Start ``python -c entry`` (code that calls ``entry_args()``) with JSON-able ``args``;
    -> the process and this side's connection."""
    mine, theirs = socket.socketpair()
    payload = json.dumps([theirs.fileno(), *args])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", entry, payload], pass_fds=[theirs.fileno()], env=env,
                            stdin=subprocess.DEVNULL)
    theirs.close()
    return proc, Connection(mine.detach())


def kill(proc: subprocess.Popen, conn: Connection) -> None:
    """SIGKILL by its own pid, reap it, close the socket."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    conn.close()


def how_it_died(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(5.0)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def stop_all(workers: list) -> None:
    """Ask each worker (anything with ``proc`` and ``conn``) to stop, give them 2 s together,
    then SIGKILL whatever has not, and reap them all."""
    for w in workers:
        try:
            w.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill(w.proc, w.conn)

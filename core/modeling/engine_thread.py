"""One thread for all of an in-process vLLM engine's work, whichever thread asks.

A Ray actor with concurrency groups runs its constructor on the main thread and its methods
on one thread per group, and a generator's engine is called from several of them (sampling,
weight pushes, the gateway's admitted calls); a composed reward scores its parts in threads.
Each thread that runs a parallel torch kernel gets an OpenMP team of its own, and once a
process's team threads outnumber its CPUs, libgomp stops spinning between parallel regions:
every small kernel of a decode step then waits for its team to be woken from a futex. On 2
cores that made a bf16 generator 0.64x the same engine called from the thread that built it
(fp32's longer kernels hid it). So ``start_engine`` builds each engine on a thread of its own
and hands out an ``OnEngineThread``: the engine is stepped and loaded there too, and only
that thread holds a team.
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import ThreadPoolExecutor


class EngineThread:
    """A single worker thread; ``call`` runs a function there and returns (or raises) what it
    did. A call from the thread itself runs at once, so nested calls cannot deadlock."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-engine")
        self.ident = self._pool.submit(threading.get_ident).result()

    def call(self, fn, /, *args, **kwargs):
        if threading.get_ident() == self.ident:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()


class OnEngineThread:
    """``target`` whose methods run on ``engine_thread``: a vLLM ``LLM``, and its ``llm_engine``
    the same way. Plain attributes (configs, versions) are read where they are asked for."""

    def __init__(self, target, engine_thread: EngineThread, nested: tuple[str, ...] = ("llm_engine",)) -> None:
        self._target, self.engine_thread, self._nested = target, engine_thread, nested

    def __getattr__(self, name: str):
        value = getattr(self._target, name)
        if name in self._nested:
            return OnEngineThread(value, self.engine_thread, ())
        if callable(value):
            return functools.partial(self.engine_thread.call, value)
        return value

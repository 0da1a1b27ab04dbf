"""Episodes at their own pace: each turn goes into the running engine as soon as its episode has
one to take, and each finished turn goes to its environment at once (env.schedule=continuous).

``ContinuousEpisodes`` plays what ``EpisodeRunner`` (actors/environments/episodes.py) plays, with
its rules for a turn, an observation, the budgets and an environment's failure, without the
rounds: the generator admits a turn's request into the engine while other episodes' requests
run (``Generator.admit_turn``, the gateway's admission: actors/admitted_calls.py), and the
environment workers take each step when it comes (EnvironmentWorkers.submit/poll). A turn that
has ended waits for its own environment only; the engine keeps sampling the other episodes'
turns meanwhile.

One thread drives it: finished turns arrive from the engine's thread through a queue, with a
byte on a pipe that wakes the wait on the environment workers. Each turn is seeded as in
rounds, by (seed, version, prompt index, sample index, turn), but what else the engine batches
beside it depends on timing, and a CPU's or GPU's kernels may round a row differently in
another batch: a redispatched chunk samples the same distribution, not necessarily the same
tokens (the rounds keep that promise; docs/guide/environments.md).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable

from actors.environments.episodes import Episode, EpisodeRunner, Turn

# Admit one turn: (transcript's exact ids, its room, its key) and what to call with the Turn
# (or the error) once sampled, from the engine's thread (Generator.admit_turn).
Admit = Callable[[list[int], int, tuple[int, int, int], Callable[[object], None]], None]


class _Wake:
    """A pipe whose read end wakes a wait on file descriptors (EnvironmentWorkers.poll)."""

    def __init__(self) -> None:
        self.read, self._write = os.pipe()
        os.set_blocking(self.read, False)
        os.set_blocking(self._write, False)
        self._open, self._lock = True, threading.Lock()

    def set(self) -> None:
        """From any thread; after ``close`` (a call that failed with turns in flight), nothing."""
        with self._lock:
            if not self._open:
                return
            try:
                os.write(self._write, b"x")
            except BlockingIOError:  # the pipe is full: it is readable already
                pass

    def clear(self) -> None:
        try:
            while os.read(self.read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            self._open = False
            os.close(self.read)
            os.close(self._write)


class ContinuousEpisodes(EpisodeRunner):
    """EpisodeRunner's episodes, each turn admitted and each step taken when it comes."""

    @staticmethod
    def sampler(generator) -> Admit:
        return generator.admit_turn

    def run(self, prompts: list[tuple[list[int], int, str, dict]], n: int, sample: Admit) -> list[Episode]:
        episodes = self._begin(prompts, n)
        by_id = {ep.episode_id: ep for ep in episodes}
        ended: queue.SimpleQueue = queue.SimpleQueue()
        wake, errors = _Wake(), []
        sampling, busy_since = 0, None
        try:
            def admit(ep: Episode) -> int:
                """The episode's next turn into the engine -> 1, or 0 where the episode is over."""
                if ep.done or ep.error or ep.turns >= self.max_turns or errors:
                    return 0
                room = self._room(ep)
                if room < 1:
                    ep.done = True  # no room for another turn, as in rounds
                    return 0
                sample(ep.prompt_ids + ep.response, room, self._key(ep),
                       lambda turn: (ended.put((ep, turn)), wake.set()))
                return 1

            sampling = sum(admit(ep) for ep in episodes)
            while sampling or self.workers.pending:
                if self.workers.pending and busy_since is None:
                    busy_since = time.perf_counter()
                answers = self.workers.poll(wake=wake.read)
                if busy_since is not None and not self.workers.pending:
                    self._env_seconds += time.perf_counter() - busy_since
                    busy_since = None
                wake.clear()  # before reading the queue: a turn put after this leaves a byte
                while not ended.empty():
                    ep, turn = ended.get()
                    sampling -= 1
                    sampling += self._turn_ended(ep, turn, errors, admit)
                for episode, got in answers.items():
                    self._answered(by_id[episode], got)
                    sampling += admit(by_id[episode])
        finally:
            wake.close()
        if errors:
            raise errors[0]
        self._call({ep.episode_id: ("close",) for ep in episodes if not ep.error})
        return episodes

    def _turn_ended(self, ep: Episode, turn, errors: list, admit: Callable[[Episode], int]) -> int:
        """A sampled turn (or the engine's error) into its episode; its step submitted -> turns admitted."""
        if not isinstance(turn, Turn):
            errors.append(turn)  # the engine failed: the call fails once every admitted turn is back
            return 0
        request = self._took(ep, turn)
        if request is None:
            return 0
        self._env_steps += 1
        got = self.workers.submit({ep.episode_id: request}).get(ep.episode_id)
        if got is None:  # sent: poll answers it
            return 0
        self._answered(ep, got)  # lost with its worker: answered at once
        return admit(ep)

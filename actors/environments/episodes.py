"""Multi-turn episodes: the policy samples a turn, an environment answers, the policy goes on.

``EpisodeRunner.run`` plays a batch of episodes in lockstep rounds: every live episode's next
turn is sampled in one call (``sample``: the engine, given each transcript's exact ids), the
finished turns go to their environments in one round (actors/environments/workers.py), and each
observation is appended as the exact ids ``ObservationTokens`` gives (actors/environments/transcript.py).
Rounds keep a batch's composition independent of how fast the environments answer, so a
resumed or redispatched run samples what the original did.

A transcript is the prompt (with ``reset``'s first observation after it), then the policy's
turns and the observations between them; the policy's tokens are kept exactly as sampled (its
ids are decoded for the environment, never encoded again), and ``action_mask`` marks them.
A turn ends at the end-of-turn token, and the environment answers every turn that ended (one
that ends exactly at ``max_tokens`` too); the episode ends when the environment says done, after
``max_turns`` turns, when a turn is cut before its end-of-turn token (``max_turn_tokens``, or
the room ``max_tokens`` leaves: no step for it, and the episode's finish_reason is "length", the
only way an episode is truncated), or when ``max_tokens`` response tokens (observations
included) leave no room for another turn; the transcript always ends on a policy token. An
environment that fails (actors/environments/workers.py's Outcome) ends its episode invalid, with the reason.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from actors.environments.transcript import ObservationTokens
from actors.environments.workers import EnvironmentWorkers, Outcome
from core.rollout import Rollout, spliced_kept_ids


@dataclass
class Turn:
    """One sampled turn: its ids, their behaviour log-probs, the policy version that sampled
    each (None: the version the episodes are played at), with a truncated sampler the kept set
    of each position ([n, K] int32, -1 padding; Rollout.kept_ids), and how many of its prompt's
    tokens the engine's prefix cache held."""
    token_ids: list[int]
    logprobs: np.ndarray
    versions: Optional[np.ndarray] = None
    kept_ids: Optional[np.ndarray] = None
    cached_tokens: int = 0


# One round of sampling: (transcripts' exact ids, the room each turn has, each turn's key
# (prompt index, sample index, turn) to seed it by) -> one Turn each (Generator.sample_turns).
Sample = Callable[[list[list[int]], list[int], list[tuple[int, int, int]]], list[Turn]]


@dataclass
class Episode:
    episode_id: int
    prompt_ids: list[int]
    prompt_index: int
    sample_index: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the policy's sampling version, or
    # an observation's, the version of the policy token before it
    kept: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (first position, a turn's kept sets)
    # (the turn's last token, its reward) for each turn the environment rewarded
    rewards: list[tuple[int, float]] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    finish_reason: str = "length"
    error: Optional[str] = None  # why the episode is invalid
    info: dict = field(default_factory=dict)  # the environment's info at its last step

    def add(self, ids: list[int], logprobs, trained: bool, versions=None, kept_ids=None) -> None:
        """Append a turn (``trained``: the policy's, sampled by ``versions`` from ``kept_ids``)
        or an observation."""
        if kept_ids is not None:
            self.kept.append((len(self.response), np.asarray(kept_ids, dtype=np.int32)))
        self.response += ids
        self.logprobs += list(logprobs) if trained else [0.0] * len(ids)
        self.mask += [trained] * len(ids)
        if versions is None:
            versions = [self.versions[-1] if self.versions else -1] * len(ids)
        self.versions += [int(v) for v in versions]

    def rollout(self, version: int, by_turn: bool = False) -> Rollout:
        """The episode as a Rollout (``version``: where no turn said which sampled it); ``by_turn``:
        with its turn rewards placed (Rollout.turn_rewards)."""
        placed = None
        if by_turn and not self.error and self.response:
            placed = np.zeros(len(self.response), np.float32)
            for at, reward in self.rewards:
                placed[at] += reward
        versions = np.asarray([version if v < 0 else v for v in self.versions], dtype=np.int64)
        return Rollout(prompt_ids=self.prompt_ids, response_ids=self.response, behaviour_logprobs=self.logprobs,
                       finish_reason=self.finish_reason, prompt_index=self.prompt_index,
                       policy_version=int(versions[0]) if versions.size else version, token_versions=versions,
                       sample_index=self.sample_index, action_mask=np.asarray(self.mask, dtype=bool),
                       env_score=self.score, env_error=self.error, turn_rewards=placed,
                       kept_ids=spliced_kept_ids(self.kept, len(self.response)))

    @property
    def score(self) -> float:
        """The environment's rewards summed; NaN for an invalid episode."""
        return float("nan") if self.error else float(sum(r for _, r in self.rewards))


class EpisodeRunner:
    """Episodes against ``workers``' environment, observations tokenized by ``observations``."""

    def __init__(self, *, workers: EnvironmentWorkers, observations: ObservationTokens, decode: Callable,
                 max_turns: int, max_tokens: int, max_turn_tokens: int, max_context: int = 1 << 30,
                 by_turn: bool = False):
        """by_turn: each turn's reward goes on that turn's last token (Rollout.turn_rewards), not
        the episode's sum on its last."""
        if min(max_turns, max_tokens, max_turn_tokens) < 1:
            raise ValueError(f"EpisodeRunner: max_turns={max_turns}, max_tokens={max_tokens} and "
                             f"max_turn_tokens={max_turn_tokens} must be >= 1")
        self.workers, self.observations, self.decode = workers, observations, decode
        self.max_turns, self.max_tokens, self.max_turn_tokens = max_turns, max_tokens, max_turn_tokens
        self.max_context = max_context  # the engine's max_model_len: prompt and transcript together
        self.by_turn = by_turn
        self._next_id = 0
        self._env_seconds, self._env_steps = 0.0, 0

    def _call(self, requests: dict) -> dict:
        """One round on the workers, timed: steps and seconds go into the call's counts."""
        t0 = time.perf_counter()
        out = self.workers.call(requests)
        self._env_seconds += time.perf_counter() - t0
        self._env_steps += sum(op == "step" for op, *_ in requests.values())
        return out

    def run(self, prompts: list[tuple[list[int], int, str, dict]], n: int, sample: Sample) -> list[Episode]:
        """``n`` episodes of each (prompt ids, prompt index, prompt text, columns); -> the episodes."""
        episodes = self._begin(prompts, n)
        for _ in range(self.max_turns):
            live = [ep for ep in episodes if not ep.done and not ep.error]
            if not live:
                break
            self._turn(live, sample)
        self._call({ep.episode_id: ("close",) for ep in episodes if not ep.error})
        return episodes

    @staticmethod
    def sampler(generator) -> Sample:
        """What ``run`` samples with, of a generator (actors/generator.py): a round at a time."""
        return generator.sample_turns

    def _begin(self, prompts: list[tuple[list[int], int, str, dict]], n: int) -> list[Episode]:
        """The episodes of ``run``'s prompts, reset."""
        episodes = []
        for ids, index, _, _ in prompts:
            for k in range(n):
                episodes.append(Episode(self._next_id, list(ids), index, k))
                self._next_id += 1
        texts = {ep.episode_id: prompts[i // n][2:] for i, ep in enumerate(episodes)}
        self._reset(episodes, texts)
        return episodes

    def play(self, prompts: list[tuple[list[int], int]], columns, tokenizer, n: int, sample: Sample,
             version: int) -> tuple[list[Rollout], dict]:
        """``run`` on (prompt ids, prompt index) pairs, the environment given each prompt's text
        and its row of ``columns`` (core/columns.py); -> the episodes' Rollouts and the call's
        counts (``episode_counts``)."""
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in prompts]
        rows = [(ids, idx, text, columns.row(idx)) for (ids, idx), text in zip(prompts, texts)]
        before = dict(self.workers.counts)
        self._env_seconds, self._env_steps = 0.0, 0
        episodes = self.run(rows, n, sample)
        faults = {k: v - before.get(k, 0) for k, v in self.workers.counts.items() if k != "restarts"}
        return [ep.rollout(version, self.by_turn) for ep in episodes], {
            **episode_counts(episodes), **faults, "steps": self._env_steps, "step_seconds": self._env_seconds}

    def close(self) -> None:
        self.workers.close()

    def _reset(self, episodes: list[Episode], texts: dict) -> None:
        out = self._call({ep.episode_id: ("reset", *texts[ep.episode_id]) for ep in episodes})
        for ep in episodes:
            got = out[ep.episode_id]
            if not got.ok:
                ep.error = got.error
            elif got.result is not None:  # the first observation belongs to the prompt: never trained
                try:
                    ep.prompt_ids = self.observations.after_prompt(ep.prompt_ids, got.result)
                except ValueError as e:
                    ep.error = str(e)

    def _turn(self, live: list[Episode], sample: Sample) -> None:
        room = [self._room(ep) for ep in live]
        for ep in [ep for ep, r in zip(live, room) if r < 1]:
            ep.done = True  # no room for another turn (a first turn: an empty, untrained episode)
        live, room = [ep for ep, r in zip(live, room) if r >= 1], [r for r in room if r >= 1]
        if not live:
            return
        turns = sample([ep.prompt_ids + ep.response for ep in live], room, [self._key(ep) for ep in live])
        answering = {}
        for ep, turn in zip(live, turns):
            request = self._took(ep, turn)
            if request is not None:
                answering[ep.episode_id] = request
        out = self._call(answering)
        for ep in live:
            if ep.episode_id in out:
                self._answered(ep, out[ep.episode_id])

    def _room(self, ep: Episode) -> int:
        """Tokens the episode's next turn may take (< 1: none)."""
        return min(self.max_turn_tokens, self.max_tokens - len(ep.response),
                   self.max_context - len(ep.prompt_ids) - len(ep.response))

    @staticmethod
    def _key(ep: Episode) -> tuple[int, int, int]:
        """What the episode's next turn is seeded by: (prompt index, sample index, turn)."""
        return ep.prompt_index, ep.sample_index, ep.turns

    def _took(self, ep: Episode, turn: Turn) -> Optional[tuple]:
        """The policy's turn into the episode -> the request its environment answers, or None."""
        ep.add(turn.token_ids, turn.logprobs, trained=True, versions=turn.versions, kept_ids=turn.kept_ids)
        ep.turns += 1
        # A turn that ended on its end-of-turn token ended, wherever it ended (at the budget, at
        # max_turns): the environment answers it. Only a turn cut before its end truncates.
        if not turn.token_ids or turn.token_ids[-1] != self.observations.end_of_turn_id:
            ep.done, ep.finish_reason = True, "length"
            return None
        ep.finish_reason = "stop"
        return "step", self.decode(turn.token_ids)

    def _answered(self, ep: Episode, got: Outcome) -> None:
        """The environment's answer to the episode's turn into the episode."""
        if not got.ok:
            ep.error = got.error
            return
        ep.info = got.result.info
        if got.result.reward is not None:
            ep.rewards.append((len(ep.response) - 1, got.result.reward))
        if got.result.done:
            ep.done, ep.finish_reason = True, "stop"
        elif got.result.observation is not None and ep.turns < self.max_turns:
            obs = self.observations.ids(got.result.observation)
            if len(ep.response) + len(obs) >= self.max_tokens:
                ep.done = True  # the observation leaves no room for a turn: end on the policy's
            else:
                ep.add(obs, None, trained=False)


# The info numbers an environment may report at an episode's last step, summed over episodes.
INFO_COUNTS = ("tool_calls", "tool_errors")


def episode_counts(episodes: list[Episode]) -> dict:
    """What a batch of episodes did, as sums (the driver adds up calls and takes the means):
    episodes, invalid ones, policy turns, the transcripts' policy and environment tokens, and
    INFO_COUNTS from each episode's last info."""
    out = {"episodes": len(episodes), "invalid": sum(ep.error is not None for ep in episodes),
           "turns": sum(ep.turns for ep in episodes), "policy_tokens": sum(sum(ep.mask) for ep in episodes),
           "env_tokens": sum(len(ep.mask) - sum(ep.mask) for ep in episodes)}
    for key in INFO_COUNTS:
        out[key] = sum(v for ep in episodes if isinstance(v := ep.info.get(key, 0), (int, float))
                       and not isinstance(v, bool) and math.isfinite(v))
    return out

"""Multi-turn episodes: the policy samples a turn, an environment answers, the policy goes on.

``EpisodeRunner.run`` plays a batch of episodes in lockstep rounds: every live episode's next
turn is sampled in one call (``sample``: the engine, given each transcript's exact ids), the
finished turns go to their environments in one round (actors/env_workers.py), and each
observation is appended as the exact ids ``ObservationTokens`` gives (actors/transcript.py).
Rounds keep a batch's composition independent of how fast the environments answer, so a
resumed or redispatched run samples what the original did.

A transcript is the prompt (with ``reset``'s first observation after it), then the policy's
turns and the observations between them; the policy's tokens are kept exactly as sampled (its
ids are decoded for the environment, never encoded again), and ``action_mask`` marks them.
A turn ends at the end-of-turn token or after ``max_turn_tokens``; the episode ends when the
environment says done, after ``max_turns`` turns, or when ``max_tokens`` response tokens
(observations included) leave no room for another turn; the transcript always ends on a
policy token. An environment that fails (actors/env_workers.py's Outcome) ends its episode
invalid, with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from actors.env_workers import EnvironmentWorkers
from actors.scoring import ScoreResult
from actors.transcript import ObservationTokens
from core.rollout import Rollout


@dataclass
class Turn:
    """One sampled turn: its ids and their behaviour log-probs."""
    token_ids: list[int]
    logprobs: np.ndarray


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
    rewards: list[float] = field(default_factory=list)  # one per turn the environment answered with one
    turns: int = 0
    done: bool = False
    finish_reason: str = "length"
    error: Optional[str] = None  # why the episode is invalid

    def add(self, ids: list[int], logprobs, trained: bool) -> None:
        self.response += ids
        self.logprobs += list(logprobs) if trained else [0.0] * len(ids)
        self.mask += [trained] * len(ids)

    def rollout(self, version: int) -> Rollout:
        return Rollout(prompt_ids=self.prompt_ids, response_ids=self.response, behaviour_logprobs=self.logprobs,
                       finish_reason=self.finish_reason, policy_version=version, prompt_index=self.prompt_index,
                       sample_index=self.sample_index, action_mask=np.asarray(self.mask, dtype=bool),
                       env_score=self.score, env_error=self.error)

    @property
    def score(self) -> float:
        """The environment's rewards summed; NaN for an invalid episode."""
        return float("nan") if self.error else float(sum(self.rewards))


class EpisodeRunner:
    """Episodes against ``workers``' environment, observations tokenized by ``observations``."""

    def __init__(self, *, workers: EnvironmentWorkers, observations: ObservationTokens, decode: Callable,
                 max_turns: int, max_tokens: int, max_turn_tokens: int, max_context: int = 1 << 30):
        if min(max_turns, max_tokens, max_turn_tokens) < 1:
            raise ValueError(f"EpisodeRunner: max_turns={max_turns}, max_tokens={max_tokens} and "
                             f"max_turn_tokens={max_turn_tokens} must be >= 1")
        self.workers, self.observations, self.decode = workers, observations, decode
        self.max_turns, self.max_tokens, self.max_turn_tokens = max_turns, max_tokens, max_turn_tokens
        self.max_context = max_context  # the engine's max_model_len: prompt and transcript together
        self._next_id = 0

    def run(self, prompts: list[tuple[list[int], int, str, dict]], n: int, sample: Sample) -> list[Episode]:
        """``n`` episodes of each (prompt ids, prompt index, prompt text, columns); -> the episodes."""
        episodes = []
        for ids, index, _, _ in prompts:
            for k in range(n):
                episodes.append(Episode(self._next_id, list(ids), index, k))
                self._next_id += 1
        texts = {ep.episode_id: prompts[i // n][2:] for i, ep in enumerate(episodes)}
        self._reset(episodes, texts)
        for _ in range(self.max_turns):
            live = [ep for ep in episodes if not ep.done and not ep.error]
            if not live:
                break
            self._turn(live, sample)
        self.workers.call({ep.episode_id: ("close",) for ep in episodes if not ep.error})
        return episodes

    def play(self, prompts: list[tuple[list[int], int]], columns, tokenizer, n: int, sample: Sample,
             version: int) -> list[Rollout]:
        """``run`` on (prompt ids, prompt index) pairs, the environment given each prompt's text
        and its row of ``columns`` (core/columns.py); -> the episodes' Rollouts."""
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in prompts]
        rows = [(ids, idx, text, columns.row(idx)) for (ids, idx), text in zip(prompts, texts)]
        return [ep.rollout(version) for ep in self.run(rows, n, sample)]

    def close(self) -> None:
        self.workers.close()

    def _reset(self, episodes: list[Episode], texts: dict) -> None:
        out = self.workers.call({ep.episode_id: ("reset", *texts[ep.episode_id]) for ep in episodes})
        for ep in episodes:
            got = out[ep.episode_id]
            if not got.ok:
                ep.error = got.error
            elif got.result is not None:  # the first observation belongs to the prompt: never trained
                ep.prompt_ids += self.observations.ids(got.result)

    def _turn(self, live: list[Episode], sample: Sample) -> None:
        room = [min(self.max_turn_tokens, self.max_tokens - len(ep.response),
                    self.max_context - len(ep.prompt_ids) - len(ep.response)) for ep in live]
        for ep in [ep for ep, r in zip(live, room) if r < 1]:
            ep.done = True  # no room for another turn (a first turn: an empty, untrained episode)
        live, room = [ep for ep, r in zip(live, room) if r >= 1], [r for r in room if r >= 1]
        if not live:
            return
        turns = sample([ep.prompt_ids + ep.response for ep in live], room,
                       [(ep.prompt_index, ep.sample_index, ep.turns) for ep in live])
        answering = {}
        for ep, turn in zip(live, turns):
            ep.add(turn.token_ids, turn.logprobs, trained=True)
            ep.turns += 1
            if len(ep.response) >= self.max_tokens:
                ep.done = True  # no room left: finish_reason stays "length"
            else:
                answering[ep.episode_id] = ("step", self.decode(turn.token_ids))
        out = self.workers.call(answering)
        for ep in live:
            if ep.episode_id not in out:
                continue
            got = out[ep.episode_id]
            if not got.ok:
                ep.error = got.error
                continue
            if got.result.reward is not None:
                ep.rewards.append(got.result.reward)
            if got.result.done:
                ep.done, ep.finish_reason = True, "stop"
            elif got.result.observation is not None and ep.turns < self.max_turns:
                obs = self.observations.ids(got.result.observation)
                if len(ep.response) + len(obs) >= self.max_tokens:
                    ep.done = True  # the observation leaves no room for a turn: end on the policy's
                else:
                    ep.add(obs, None, trained=False)


def episode_runner(env: dict, tokenizer, max_context: int, name: str) -> EpisodeRunner:
    """The runner a generator plays episodes with: ``env`` as cluster.config.env.EnvConfig's
    runner_kwargs give it, observations rendered by the policy's ``tokenizer``."""
    workers = EnvironmentWorkers(env["spec"], key="env.environment", workers=env["workers"],
                                 step_timeout_s=env["step_timeout_s"], memory_mb=env["memory_mb"])
    try:
        observations = ObservationTokens(tokenizer, role=env["observation_role"], plain_format=env["plain_format"],
                                         name=f"{name}'s tokenizer")
    except ValueError:
        workers.close()
        raise
    return EpisodeRunner(workers=workers, observations=observations,
                         decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         max_turns=env["max_turns"], max_tokens=env["max_tokens"],
                         max_turn_tokens=env["max_turn_tokens"], max_context=max_context)


def environment_scores(rollouts: list[Rollout]) -> ScoreResult:
    """The episodes' own scores (their environment rewards summed) as a reward's result: an
    invalid episode's item invalid, one line per reason with its count."""
    scores = np.array([np.nan if r.env_score is None else r.env_score for r in rollouts], dtype=np.float32)
    valid = np.isfinite(scores)
    reasons: dict[str, int] = {}
    for r, ok in zip(rollouts, valid):
        if not ok:
            why = r.env_error or "the rollout was not played against an environment"
            reasons[why] = reasons.get(why, 0) + 1
    errors = [f"{why} ({n} of {len(rollouts)} episodes invalid)" for why, n in reasons.items()]
    return ScoreResult(np.where(valid, scores, np.nan).astype(np.float32), valid, errors)

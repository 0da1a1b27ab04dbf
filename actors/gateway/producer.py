"""Agent episodes as a step's rollouts: sessions opened, agents played, transcripts collected.

``AgentEpisodes.play`` opens ``n`` sessions per prompt on the gateway (seeded by the prompt's
index and the sample's), plays them with the user's agent (agents.py), closes them and turns
each session's transcripts into Rollouts: the prompt and the ids of the policy's calls with the
context between them masked (``action_mask``), each token's behaviour log-prob and version,
and the episode's score (``env_score``: what the agent returned, or posted to
``/sessions/<id>/reward``; None leaves it to the reward pool) or why the episode is invalid
(``env_error``). A session whose history was rewritten makes one rollout per transcript, all
with the episode's score; a session the agent never called makes none and is counted.
"""
from __future__ import annotations

import itertools
import uuid
from typing import Optional

import numpy as np

from actors.gateway.agents import AgentOutcome, AgentWorkers
from actors.gateway.sessions import Session, Transcript
from core.rollout import Rollout


def episode_outcome(session: Session, outcome: AgentOutcome) -> AgentOutcome:
    """The agent's outcome with a posted reward as its score (the agent returned None); an agent
    that both returned a score and posted one is invalid: the episode has one score."""
    if not outcome.ok or session.score is None:
        return outcome
    if outcome.score is not None:
        return AgentOutcome(error=f"the agent returned {outcome.score} and posted {session.score} for session "
                                  f"{session.sid!r}; an episode has one score: return it or post it")
    return AgentOutcome(score=session.score)


def transcript_rollout(t: Transcript, session: Session, outcome: AgentOutcome) -> Rollout:
    versions = np.asarray(t.versions, dtype=np.int64)
    return Rollout(prompt_ids=np.asarray(t.prompt_ids, dtype=np.int64), response_ids=np.asarray(t.response, np.int64),
                   behaviour_logprobs=np.asarray(t.logprobs, dtype=np.float32), finish_reason=t.finish_reason,
                   policy_version=int(versions[0]), prompt_index=session.prompt_index,
                   sample_index=session.sample_index, token_versions=versions,
                   action_mask=np.asarray(t.mask, dtype=bool), kept_ids=t.kept_ids(),
                   env_score=float("nan") if outcome.error else outcome.score, env_error=outcome.error)


def agent_counts(sessions: list[Session], outcomes: list[AgentOutcome], replayed: int) -> dict:
    """One play's counts (summed over generators and steps into the agent/* metrics)."""
    return {"sessions": len(sessions), "calls": sum(s.counts["calls"] for s in sessions),
            "invalid": sum(not o.ok for o in outcomes), "errors": sum(not (o.ok or o.timed_out or o.crashed)
                                                                 for o in outcomes),
            "timeouts": sum(o.timed_out for o in outcomes), "crashes": sum(o.crashed for o in outcomes),
            "retokenize_mismatch": sum(s.counts["retokenize_mismatch"] for s in sessions),
            "rewritten": sum(s.counts["rewritten"] for s in sessions),
            "without_calls": sum(not s.transcripts for s in sessions), "replayed": replayed,
            **{k: sum(s.counts[k] for s in sessions) for k in ("prompt_tokens", "cached_tokens")}}


class AgentEpisodes:
    """Plays agent episodes through ``gateway`` (a Gateway actor's handle) with ``agents``; the
    sessions' calls go to ``replica`` (this generator, by name) while it lives."""

    def __init__(self, *, gateway, agents: AgentWorkers, name: str = "episodes", replica: Optional[str] = None,
                 reward_from_agent: bool = True, attempts: int = 3) -> None:
        self.gateway, self.workers, self.name, self.replica = gateway, agents, name, replica
        self.reward_from_agent, self.attempts = reward_from_agent, int(attempts)
        self._batches = itertools.count()
        self._run = uuid.uuid4().hex[:8]  # a replacement of this generator opens sessions of other ids

    @staticmethod
    def sampler(generator) -> None:
        """The gateway samples an agent's calls (Generator.serve_turn): play takes no sampler."""
        return None

    def play(self, prompts: list[tuple[list[int], int]], columns, tokenizer, n: int, *_) -> tuple[list[Rollout], dict]:
        """``n`` episodes of each (prompt ids, prompt index), the agent given the prompt's text and
        its row of ``columns`` -> their rollouts and counts (as the episode runner's play; the
        gateway samples, so its sampler and version arguments are not used)."""
        rows = {idx: (tokenizer.decode(ids, skip_special_tokens=True), columns.row(idx)) for ids, idx in prompts}
        todo, done, replayed = [(idx, k) for _, idx in prompts for k in range(n)], {}, 0
        for _ in range(self.attempts):
            lost = self._play_once(todo, rows, done)
            if not lost:
                break
            replayed += len(lost)
            todo = lost
        keys = sorted(done)
        sessions, outcomes = [done[key][0] for key in keys], [done[key][1] for key in keys]
        lost = [key for key in todo if key not in done]
        for key in lost:  # the gateway lost them on every attempt
            sessions.append(Session(f"lost-{key}", prompt_index=key[0], sample_index=key[1]))
            outcomes.append(AgentOutcome(error=f"the gateway restarted during this episode {self.attempts} times"))
        rollouts = [transcript_rollout(t, s, o) for s, o in zip(sessions, outcomes) for t in s.transcripts]
        return rollouts, agent_counts(sessions, outcomes, replayed)

    def _play_once(self, keys: list[tuple[int, int]], rows: dict, done: dict) -> list[tuple[int, int]]:
        """Plays ``keys`` (prompt index, sample index) into ``done``; -> the keys whose sessions the
        gateway lost (it restarted: they are played again, from the start, with the same seeds)."""
        import ray

        batch = next(self._batches)
        sids = [f"{self.name}-{self._run}-{batch}-{index}-{k}" for index, k in keys]
        me = self._me()
        urls = ray.get([self.gateway.open_session.remote(sid, prompt_index=index, sample_index=k, **me)
                        for sid, (index, k) in zip(sids, keys)])
        try:
            outcomes = self.workers.run({i: (url, *rows[index]) for i, (url, (index, _)) in enumerate(zip(urls, keys))})
        finally:
            sessions = ray.get([self.gateway.close_session.remote(sid) for sid in sids])
        lost = []
        for i, (key, session) in enumerate(zip(keys, sessions)):
            if session is None:
                lost.append(key)
                continue
            outcome = episode_outcome(session, outcomes[i])
            if outcome.ok and outcome.score is None and self.reward_from_agent:
                outcome = AgentOutcome(error=f"agent {self.workers.spec} returned None and posted no reward for "
                                             "its episode; with env.reward=environment the agent scores it")
            done[key] = (session, outcome)
        return lost

    def _me(self) -> dict:
        """open_session's binding to this generator (inside its actor), else none."""
        import ray

        if self.replica is None:
            return {}
        ctx = ray.get_runtime_context()
        return {"replica": self.replica, "handle": ctx.current_actor, "incarnation": ctx.get_actor_id()}

    def close(self) -> None:
        self.workers.close()


def agent_episodes(env, *, gateway, name: str) -> AgentEpisodes:
    """A generator's agent episodes (``env``: the EnvConfig with env.agent set), its workers started."""
    if gateway is None:
        raise ValueError(f"{name}: env.agent={env.agent!r} plays through the run's gateway; none was given")
    agents = AgentWorkers(env.agent, workers=env.workers, episode_timeout_s=env.episode_timeout_s,
                          memory_mb=env.memory_mb, per_worker=env.episodes_per_worker)
    return AgentEpisodes(gateway=gateway, agents=agents, name=name, replica=name,
                         reward_from_agent=env.reward == "environment")

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


class AgentEpisodes:
    """Plays agent episodes through ``gateway`` (a Gateway actor's handle) with ``agents``."""

    def __init__(self, *, gateway, agents: AgentWorkers, name: str = "episodes") -> None:
        self.gateway, self.agents, self.name = gateway, agents, name
        self._batches = itertools.count()

    def play(self, rows: list[tuple[int, str, dict]], n: int) -> tuple[list[Rollout], dict]:
        """``n`` episodes of each (prompt index, prompt text, columns) -> their rollouts and counts."""
        import ray

        batch = next(self._batches)
        keys = [(index, k) for index, _, _ in rows for k in range(n)]
        sids = [f"{self.name}-{batch}-{index}-{k}" for index, k in keys]
        urls = ray.get([self.gateway.open_session.remote(sid, prompt_index=index, sample_index=k)
                        for sid, (index, k) in zip(sids, keys)])
        texts = {index: (text, columns) for index, text, columns in rows}
        try:
            outcomes = self.agents.run({i: (url, *texts[index]) for i, (url, (index, _)) in enumerate(zip(urls, keys))})
        finally:
            sessions = ray.get([self.gateway.close_session.remote(sid) for sid in sids])
        outcomes = {i: episode_outcome(s, outcomes[i]) for i, s in enumerate(sessions)}
        rollouts = [transcript_rollout(t, s, outcomes[i]) for i, s in enumerate(sessions) for t in s.transcripts]
        calls = sum(s.counts["calls"] for s in sessions)
        return rollouts, {"sessions": len(sessions), "calls": calls, "calls_per_session": calls / max(1, len(sessions)),
                          "errors": sum(not o.ok for o in outcomes.values()),
                          "timeouts": sum(o.timed_out for o in outcomes.values()),
                          "retokenize_mismatch": sum(s.counts["retokenize_mismatch"] for s in sessions),
                          "without_calls": sum(not s.transcripts for s in sessions)}

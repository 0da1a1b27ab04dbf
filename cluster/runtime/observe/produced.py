"""Produced: the accounting of one batch of prompts turned into scored rollouts in the buffer."""
from __future__ import annotations

from dataclasses import dataclass, field

from core.infra.transfer import Transfer


@dataclass
class Produced:
    """One batch of prompts turned into scored rollouts in the buffer, with what was lost on the way."""
    stored: int = 0               # scored rollouts put into the buffer
    prompts: int = 0
    skipped_prompts: int = 0      # too long for the model
    invalid_scores: int = 0       # reward returned NaN/inf or raised
    empty_responses: int = 0
    duplicate_chunks: int = 0     # chunks the buffer had already stored (exactly-once at work)
    redispatched_chunks: int = 0  # chunks sent again because the replica holding them died
    filtered_prompts: int = 0     # dynamic sampling: prompts left out, their samples all scored alike
    extra_rollouts: int = 0       # dynamic sampling: rollouts of the prompt batches drawn to refill the step
    incomplete_kept_sets: int = 0  # sampled positions whose top-k kept set may hold more than was read
    generate_seconds: float = 0.0
    score_seconds: float = 0.0    # scoring time not hidden behind generation
    tokens: int = 0
    per_generator_tps: dict = field(default_factory=dict)  # replica id -> tokens/s
    score_latency: dict = field(default_factory=dict)      # pool -> seconds of each scoring call
    reward_counts: dict = field(default_factory=dict)      # the reward calls' counters, summed: reward/<name>
    episode_counts: dict = field(default_factory=dict)     # multi-turn episodes' counts, summed (episode_metrics)
    to_scorers: Transfer = Transfer()  # rollouts pulled by the reference and reward replicas
    to_buffer: Transfer = Transfer()   # rollouts, reference log-probs and scores pulled by the buffer

    def merge(self, other: "Produced") -> "Produced":
        """Accounting of two batches together (async mode sums what fed one step)."""
        latency = {k: self.score_latency.get(k, []) + other.score_latency.get(k, [])
                   for k in set(self.score_latency) | set(other.score_latency)}
        sums = {f: getattr(self, f) + getattr(other, f) for f in
                ("stored", "prompts", "skipped_prompts", "invalid_scores",
                 "empty_responses", "duplicate_chunks", "redispatched_chunks", "filtered_prompts",
                 "extra_rollouts", "incomplete_kept_sets", "generate_seconds", "score_seconds", "tokens",
                 "to_scorers", "to_buffer")}
        return Produced(**sums, per_generator_tps={**self.per_generator_tps, **other.per_generator_tps},
                        score_latency=latency, reward_counts=add_counts(self.reward_counts, other.reward_counts),
                        episode_counts=add_counts(self.episode_counts, other.episode_counts))


def add_counts(a: dict, b) -> dict:
    """Two sets of named counts summed name by name (``b``: a dict or (name, number) pairs)."""
    out = dict(a)
    for k, v in dict(b).items():
        out[k] = out.get(k, 0) + v
    return out


AGENT_COUNTS = ("sessions", "invalid", "errors", "timeouts", "crashes", "retokenize_mismatch", "rewritten",
                "without_calls", "replayed")


def episode_metrics(counts: dict) -> dict:
    """The episode/* and env/* metrics of a step's summed episode counts, or an agent's agent/*
    ({} without episodes)."""
    if counts.get("sessions"):  # actors/gateway/producer.py's agent_counts
        prompt_tokens = max(counts.get("prompt_tokens", 0), 1)
        return {"agent/calls_per_session": counts["calls"] / counts["sessions"],
                "gateway/prefix_cache_hit_rate": counts.get("cached_tokens", 0) / prompt_tokens,
                **{f"agent/{k}": counts.get(k, 0) for k in AGENT_COUNTS}}
    if not counts.get("episodes"):
        return {}
    tokens = counts["policy_tokens"] + counts["env_tokens"]
    return {"episode/turns_mean": counts["turns"] / counts["episodes"],
            "episode/env_tokens_frac": counts["env_tokens"] / max(tokens, 1),
            "episode/invalid": counts["invalid"],
            "env/steps": counts["steps"], "env/step_seconds": counts["step_seconds"],
            **{f"env/{k}": counts.get(k, 0) for k in ("errors", "timeouts", "crashes", "malformed_actions",
                                                     "lost", "tool_calls", "tool_errors")}}


def kept_set_warning(produced: Produced) -> str:
    """The console's warning for a step whose kept sets came back incomplete ('' when none)."""
    n = produced.incomplete_kept_sets
    if not n:
        return ""
    return (f"warning: {n} sampled position{'s' if n != 1 else ''} this step kept more tokens tied at the "
            "top_k-th logit than the generator read, so the KL and the PPO ratio there renormalise over too "
            "few tokens (rollouts/incomplete_kept_sets); a float32 generator "
            "(generator.engine.dtype=float32) ties far less")


def transfer_metrics(produced: Produced, to_learner: Transfer) -> dict:
    """A step's ``transfer/*`` metrics: bytes that crossed nodes on each hop of the rollouts
    (generator -> scorers, -> buffer, buffer -> learner ranks), and bytes and seconds in all."""
    hops = {"to_scorers": produced.to_scorers, "to_buffer": produced.to_buffer, "to_learner": to_learner}
    total = Transfer.total(hops.values())
    return {"transfer/cross_node_bytes": total.bytes_cross_node,
            "transfer/cross_node_seconds": total.seconds_cross_node,
            **{f"transfer/{hop}_bytes": t.bytes_cross_node for hop, t in hops.items()}}

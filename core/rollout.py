"""The data units that flow from the rollout side to the learner.

Arrays are numpy (cheap to pickle through Ray's object store, no torch needed on
the consumer to read them). Shapes: P = prompt length, R = response length of
this one rollout (no padding inside a unit; padding happens when a batch is made).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

FINISH_REASONS = ("stop", "length")


@dataclass
class Rollout:
    """One sampled response to one prompt, as the generator produced it."""
    prompt_ids: np.ndarray          # [P] int64: prompt tokens
    response_ids: np.ndarray        # [R] int64: sampled tokens, EOS included when finish_reason == "stop"
    behaviour_logprobs: np.ndarray  # [R] float32: log pi_behaviour(token) under the tempered sampling distribution
    finish_reason: str              # "stop" (EOS or stop string) | "length" (cut at max_new_tokens)
    policy_version: int             # version of the weights that sampled it
    prompt_index: int               # position of the prompt in the driver's batch / dataset
    sample_index: int               # which of the n samples for that prompt
    # [R] int64: version of the weights that sampled each token. A weight push that lands
    # mid-generation (async mode's partial rollouts) makes it step up inside one response;
    # policy_version is its first (oldest) entry. None: every token is policy_version's.
    token_versions: np.ndarray = None
    # [R, K] int32: with truncated sampling (top-k / top-p), the ids of the tokens the sampler
    # kept at each position, -1 padding a row; the reference and the learner renormalise
    # over this set (core.sampling). None: untruncated sampling, the whole vocabulary.
    kept_ids: np.ndarray = None
    # [R] bool: True where the policy sampled the token (trained on), False where an environment
    # wrote it (a multi-turn transcript's observations: context for the next turn, never trained,
    # no KL, no reward). The transcript ends on a policy token. None: every token is the policy's.
    action_mask: np.ndarray = None
    # A multi-turn episode's environment rewards summed (actors/environments/episodes.py), and why the episode
    # is invalid (its score then NaN); both None for a rollout no environment played.
    env_score: float = None
    env_error: str = None
    # [R] float32: an episode rewarded turn by turn (env.reward_placement=turn): each turn's
    # environment reward on that turn's last token, 0 elsewhere; the rewards go there instead of
    # the score going on the last token. None: the score on the last token.
    turn_rewards: np.ndarray = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int64)
        self.behaviour_logprobs = np.asarray(self.behaviour_logprobs, dtype=np.float32)
        if self.response_ids.shape != self.behaviour_logprobs.shape:
            raise ValueError(f"Rollout: response_ids shape {self.response_ids.shape} does not match "
                             f"behaviour_logprobs shape {self.behaviour_logprobs.shape}")
        if self.token_versions is None:
            self.token_versions = np.full(self.response_ids.shape, self.policy_version, dtype=np.int64)
        self.token_versions = np.asarray(self.token_versions, dtype=np.int64)
        if self.token_versions.shape != self.response_ids.shape:
            raise ValueError(f"Rollout: token_versions shape {self.token_versions.shape} does not match "
                             f"response_ids shape {self.response_ids.shape}")
        if self.token_versions.size and (self.token_versions.min() != self.policy_version
                                         or np.any(np.diff(self.token_versions) < 0)):
            raise ValueError(f"Rollout: token_versions must start at policy_version={self.policy_version} "
                             "and never decrease")
        if self.kept_ids is not None:
            self.kept_ids = np.asarray(self.kept_ids, dtype=np.int32)
            if self.kept_ids.ndim != 2 or self.kept_ids.shape[0] != self.response_ids.size:
                raise ValueError(f"Rollout: kept_ids shape {self.kept_ids.shape} must be "
                                 f"[{self.response_ids.size}, K] (one kept set per response token)")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Rollout: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if self.action_mask is not None:
            self.action_mask = _checked_action_mask(self.action_mask, self.response_ids.size)
        if self.turn_rewards is not None:
            self.turn_rewards = np.asarray(self.turn_rewards, dtype=np.float32).reshape(-1)
            trained = np.ones(self.response_ids.size, bool) if self.action_mask is None else self.action_mask
            if (self.turn_rewards.shape != self.response_ids.shape or not np.isfinite(self.turn_rewards).all()
                    or np.any(self.turn_rewards[~trained] != 0)):
                raise ValueError(f"Rollout: turn_rewards must be {self.response_ids.size} finite values (one per "
                                 "response token), 0 on the environment's tokens")

    @property
    def trained_tokens(self) -> int:
        """Response tokens the policy sampled (all of them without an action mask)."""
        return self.response_ids.size if self.action_mask is None else int(self.action_mask.sum())

    @property
    def truncated(self) -> bool:
        """Cut at max length without EOS: gets the configured truncation penalty."""
        return self.finish_reason == "length"

    @property
    def partial(self) -> bool:
        """Sampled by more than one policy version (a weight push landed mid-response)."""
        return bool(self.token_versions.size) and int(self.token_versions[-1]) != self.policy_version


def _checked_action_mask(mask, n: int) -> np.ndarray:
    """[n] bool; a ValueError unless it holds 0/1 values, one per response token, the last 1."""
    raw = np.asarray(mask)
    if raw.shape != (n,) or not np.isin(raw, (0, 1)).all():
        raise ValueError(f"Rollout: action_mask must be {n} values of 0/1 (one per response token), "
                         f"got shape {raw.shape}")
    out = raw.astype(bool)
    if n and not out[-1]:
        raise ValueError("Rollout: action_mask must end on a policy token (a transcript ends with the policy's turn)")
    return out


@dataclass
class ScoredRollout(Rollout):
    """A Rollout annotated by the reference and reward pools; what the learner trains on."""
    reference_logprobs: np.ndarray = None  # [R] float32: log pi_ref(token), same temperature convention
    kl: np.ndarray = None                  # [R] float32: per-token KL estimate (behaviour vs reference)
    rewards: np.ndarray = None             # [R] float32: -beta*kl_t, plus the score on the last token
    score: float = 0.0                     # reward-model / reward-function score of the whole sequence
    chunk_id: int = -1                     # the driver's prompt chunk it came from (set by the buffer)
    # The score as it entered ``rewards`` (clipped, plus any truncation penalty), float32 like
    # them: what the group estimators compare. None: ``score`` (no shaping).
    reward_score: float = None
    # [R] float32: an episode rewarded turn by turn, its turn rewards as they entered ``rewards``
    # (each clipped, on its turn's last token; the truncation penalty added on the last token), so
    # the group estimators credit each turn by its return (core/turn_credit.py). None: the score
    # on the last token.
    placed_rewards: np.ndarray = None
    # reward.sources: each source's own score of this rollout by its name (the score combines them);
    # None: one source.
    components: dict = None
    # [R] float32: log pi_teacher(token) of a run with a teacher (on-policy distillation), same
    # temperature and kept sets as the reference's; None: no teacher.
    teacher_logprobs: np.ndarray = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = np.asarray(self.teacher_logprobs, dtype=np.float32).reshape(-1)
            if self.teacher_logprobs.shape != self.response_ids.shape:
                raise ValueError(f"ScoredRollout: teacher_logprobs shape {self.teacher_logprobs.shape} does not "
                                 f"match response_ids shape {self.response_ids.shape}")
        if self.placed_rewards is not None:
            self.placed_rewards = np.asarray(self.placed_rewards, dtype=np.float32).reshape(-1)
            if self.placed_rewards.shape != self.response_ids.shape:
                raise ValueError(f"ScoredRollout: placed_rewards shape {self.placed_rewards.shape} does not "
                                 f"match response_ids shape {self.response_ids.shape}")
        if self.reward_score is None:
            self.reward_score = float(np.float32(self.score))
        for name in ("reference_logprobs", "kl", "rewards"):
            arr = np.asarray(getattr(self, name), dtype=np.float32)
            if arr.shape != self.response_ids.shape:
                raise ValueError(f"ScoredRollout: {name} shape {arr.shape} does not match "
                                 f"response_ids shape {self.response_ids.shape}")
            setattr(self, name, arr)


@dataclass(frozen=True)
class FrozenLogprobs:
    """What a reference replica returns for a chunk: per rollout, the [R_i] float32 log-probs of its
    response tokens under the reference, and under the teacher where the replica hosts one."""
    reference: list
    teacher: list = None  # None: the run has no teacher

    @classmethod
    def of(cls, value) -> "FrozenLogprobs":
        """``value`` as FrozenLogprobs: a plain list is the reference's log-probs alone (a scorer
        without a teacher, the learner scoring the reference)."""
        return value if isinstance(value, cls) else cls(reference=list(value))


def spliced_kept_ids(spans: list, length: int):
    """[length, K] int32 kept sets of a multi-turn transcript from its spans (first position, a
    turn's [n, K] kept sets), padded with -1 (rows no span covers, an environment's, all -1);
    None when no span has any (untruncated sampling): Rollout.kept_ids."""
    if not spans:
        return None
    out = np.full((length, max(k.shape[1] for _, k in spans)), -1, dtype=np.int32)
    for start, k in spans:
        out[start:start + k.shape[0], :k.shape[1]] = k
    return out


def prompt_groups(rollouts: list) -> list[list[int]]:
    """Row indices of each prompt group, groups in order of first appearance, rows in batch order.

    A group is the rows of one (chunk_id, prompt_index); a row with no chunk (chunk_id < 0)
    is a group of its own.
    """
    groups: dict = {}
    for i, r in enumerate(rollouts):
        key = (r.chunk_id, r.prompt_index) if r.chunk_id >= 0 else ("row", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def shard_rollouts(rollouts: list, world_size: int) -> list[list]:
    """Shards for ``world_size`` learner ranks: whole prompt groups, every rollout kept.

    The groups (``prompt_groups``) are laid out one after another and cut into ``world_size``
    consecutive runs, each cut at the group boundary nearest an equal share of the rows.
    The shards in rank order are the batch (its groups gathered), so global row k is the
    same row as in one process: with shuffling off, minibatch k is rows k*M .. k*M+M-1 there
    and here. Deterministic (a resumed run shards alike); ranks may hold unequal numbers of
    rows (learner/objectives/ppo.py runs the same minibatches and micro-batches on every rank).
    """
    groups = prompt_groups(rollouts)
    if len(groups) < world_size:
        raise ValueError(f"learner: {len(groups)} prompt groups cannot give each of {world_size} ranks one; "
                         f"train on at least {world_size} prompts per step")
    ends = np.cumsum([len(g) for g in groups])  # rows up to and including group j
    cuts, lo = [0], 0
    for r in range(1, world_size):
        share = r * len(rollouts) / world_size
        # groups lo+1 .. len-(W-r): every rank before and after keeps at least one group
        options = range(lo + 1, len(groups) - (world_size - r) + 1)
        lo = min(options, key=lambda k: (abs(ends[k - 1] - share), k))
        cuts.append(lo)
    cuts.append(len(groups))
    return [[rollouts[i] for g in groups[a:b] for i in g] for a, b in zip(cuts, cuts[1:])]


def trained_spans(action_mask: np.ndarray, versions: np.ndarray) -> list[list]:
    """[[start, end, trained, version], ...]: the response's runs of policy (trained) and
    environment tokens, a run also ending where the sampling version changes (a push landed)."""
    mask, versions = np.asarray(action_mask, dtype=bool), np.asarray(versions, dtype=np.int64)
    change = (mask[1:] != mask[:-1]) | (versions[1:] != versions[:-1])
    edges = [0, *(np.flatnonzero(change) + 1).tolist(), mask.size]
    return [[a, b, bool(mask[a]), int(versions[a])] for a, b in zip(edges, edges[1:]) if b > a]


def batch_components(rollouts: list):
    """name -> [N] float64: each reward source's scores of ``rollouts`` (ScoredRollout.components);
    None unless every rollout has them (a run with one source)."""
    if not rollouts or any(r.components is None for r in rollouts):
        return None
    return {name: np.array([r.components[name] for r in rollouts], dtype=np.float64) for name in rollouts[0].components}


def staleness(rollouts: list, version: int) -> np.ndarray:
    """[N] int64: how many versions behind ``version`` the policy that sampled each rollout was."""
    return np.array([max(0, version - r.policy_version) for r in rollouts], dtype=np.int64)


@dataclass(frozen=True)
class BatchSummary:
    """Per-rollout figures of one training batch, for metrics: numbers, never the rollouts.

    The buffer makes it beside the learner shards, so the driver logs a step without
    deserialising a single rollout. N = rollouts in the batch.
    """
    scores: np.ndarray          # [N] float64: sequence scores
    kl_sums: np.ndarray         # [N] float64: per-sequence sum of the per-token KL
    response_lengths: np.ndarray  # [N] int64
    truncated: np.ndarray       # [N] bool: cut at max_new_tokens
    staleness: np.ndarray       # [N] int64: learner version - policy_version that sampled it
    token_staleness: np.ndarray = None  # [N] float64: per rollout, mean of learner version - token version
    partial: np.ndarray = None  # [N] bool: sampled by more than one version (partial rollout)
    surplus: int = 0            # dynamic sampling: rollouts of whole groups beyond the step's batch, left out
    # (chunk_id, prompt_index) of every rollout that left the buffer since the previous
    # take: this batch's and the ones discarded as stale. The driver's ledger uses it to
    # know which prompts the buffer no longer holds (what a dead buffer would lose).
    consumed: tuple = ()
    buffer_depth: int = 0       # rollouts left in the buffer after this take
    dropped_stale: int = 0      # rollouts the buffer has dropped as stale so far
    samples: tuple = field(default_factory=tuple)  # a few rows (dicts of plain values) for samples.jsonl
    prompt_indices: np.ndarray = None  # [N] int64: each rollout's prompt (dataset id), for per-source metrics
    components: dict = None     # reward.sources: name -> [N] float64, each source's scores; None: one source

    @classmethod
    def of(cls, rollouts: list, *, current_version: int, n_samples: int = 4,
           consumed: tuple = (), buffer_depth: int = 0, dropped_stale: int = 0, surplus: int = 0) -> "BatchSummary":
        firsts = [r for r in rollouts if r.sample_index == 0][:n_samples]  # distinct prompts
        samples = tuple({"prompt_ids": r.prompt_ids.tolist(), "response_ids": r.response_ids.tolist(),
                         "score": float(r.score), "kl_sum": float(np.sum(r.kl)),
                         "finish_reason": r.finish_reason, "policy_version": r.policy_version,
                         "prompt_index": r.prompt_index,
                         **({} if r.components is None else {"components": dict(r.components)}),
                         **({} if r.action_mask is None else {"spans": trained_spans(r.action_mask, r.token_versions)})}
                        for r in firsts)
        return cls(scores=np.array([r.score for r in rollouts], dtype=np.float64),
                   kl_sums=np.array([float(np.sum(r.kl)) for r in rollouts], dtype=np.float64),
                   response_lengths=np.array([r.response_ids.size for r in rollouts], dtype=np.int64),
                   truncated=np.array([r.truncated for r in rollouts], dtype=bool),
                   staleness=staleness(rollouts, current_version),
                   token_staleness=np.array([float(np.mean(np.maximum(0, current_version - r.token_versions)))
                                             if r.token_versions.size else 0.0 for r in rollouts]),
                   partial=np.array([r.partial for r in rollouts], dtype=bool),
                   prompt_indices=np.array([r.prompt_index for r in rollouts], dtype=np.int64),
                   components=batch_components(rollouts),
                   surplus=surplus, samples=samples, consumed=tuple(consumed),
                   buffer_depth=buffer_depth, dropped_stale=dropped_stale)

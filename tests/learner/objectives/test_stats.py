"""UpdateStats: the typed running sums of a PPO update and the ppo/* metrics made from them."""
import pytest

from learner.objectives.stats import UpdateStats

pytestmark = pytest.mark.unit


def rank_stats(scale: float) -> UpdateStats:
    s = UpdateStats()
    for tokens in (4.0, 6.0):  # two micro-batches, then one optimizer step, twice
        s.add_policy(0.5 * scale, clip_frac=0.5, approx_kl=0.01 * scale, tokens=tokens)
        s.add_value(2.0 * scale, vf_clip_frac=0.25 * scale, tokens=tokens)
        s.add_micro_batch(entropy_sum=3.0 * tokens, tokens=tokens)
        s.add_forward(fed=10.0 * scale, real=5.0 + tokens)  # the forward ran on padding too
    s.add_optimizer_step(grad_norm=1.0, lr=1e-3)
    s.ptx_loss += 2.0 * scale
    s.add_optimizer_step(grad_norm=3.0, lr=2e-3)
    return s


def with_other_rank(b: UpdateStats):
    """The all-reduce as one rank sees it: rank ``b``'s partial sums added to its own."""
    theirs = []
    b.metrics(lambda values: theirs.extend(values) or list(values), world_size=1, with_ptx=True)
    return lambda values: [x + y for x, y in zip(values, theirs)]


def test_metrics_over_two_ranks_by_hand():
    a, b = rank_stats(1.0), rank_stats(3.0)
    got = a.metrics(with_other_rank(b), world_size=2, with_ptx=True)
    # Each rank: 2 optimizer steps, 10 tokens. Losses sum over micro-batches and ranks, per step.
    assert got == pytest.approx({
        "ppo/policy_loss": (0.5 * 2 + 1.5 * 2) / 2,     # 2.0
        "ppo/value_loss": (2.0 * 2 + 6.0 * 2) / 2,      # 8.0
        "ppo/entropy": (30.0 + 30.0) / 20,              # 3.0: a per-token mean
        "ppo/approx_kl": (0.01 * 10 + 0.03 * 10) / 20,  # token-weighted
        "ppo/clip_frac": 0.5,
        "ppo/vf_clip_frac": (0.25 * 10 + 0.75 * 10) / 20,
        "ppo/grad_norm": (1.0 + 3.0) / 2,               # rank-local: DeepSpeed's norm is global already
        "ppo/lr": 2e-3,                                 # the last step's
        "ppo/ptx_loss": (2.0 + 6.0) / (2 * 2),          # mean over steps and ranks
        "perf/learner_padding_frac": 1 - (20 + 20) / (20 + 60),  # padded positions over all fed, both ranks
    })
    assert set(a.metrics(lambda xs: list(xs), world_size=1, with_ptx=False)) == set(got) - {"ppo/ptx_loss"}


def test_epoch_summary_counts_only_what_the_epoch_added():
    s = rank_stats(1.0)
    before = s.copy()
    s.add_policy(0.3, clip_frac=1.0, approx_kl=0.2, tokens=5.0)
    s.add_value(0.7, vf_clip_frac=0.0, tokens=5.0)
    s.add_micro_batch(entropy_sum=1.0, tokens=5.0)
    s.add_optimizer_step(grad_norm=2.0, lr=1e-3)
    assert s.since(before).epoch_summary() == pytest.approx(
        {"policy_loss": 0.3, "value_loss": 0.7, "clip_frac": 1.0, "approx_kl": 0.2})
    assert before.optimizer_steps == 2 and s.optimizer_steps == 3  # the snapshot is a copy

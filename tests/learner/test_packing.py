"""Packed (padding-free) micro-batches (learner/packing.py): the packed forward gives the padded
one's log-probs, values and entropy, no sequence sees another, micro-batches cut by tokens are
deterministic and within budget, and a PPO update trains the same weights packed or padded,
on one rank and on two ranks that cut different numbers of micro-batches (fp32, tiny policy)."""
import dataclasses

import numpy as np
import pytest
import torch
from helpers import make_rollouts, max_abs_diff, sgd_config

from core.modeling.varlen_attention import VARLEN
from core.rollout import Rollout, shard_rollouts
from learner.batch import collate
from learner.group import LearnerGroup
from learner.objectives.minibatches import minibatch_plan, visit_order
from learner.packing import pack, row_groups, token_bins
from learner.policy import PolicyWithValueHead
from learner.worker import LearnerWorker

TOL = 1e-5
PROMPTS, RESPONSES = (2, 11, 5, 8, 3, 12), (40, 1, 17, 3, 28, 9)  # ragged, most prompts left-padded


# ------------------------------------------------------------------------ micro-batches by tokens


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(5))
def test_token_bins_hold_every_row_once_within_the_budget_the_same_every_time(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, rng.integers(1, 40)).tolist()
    budget = int(rng.integers(30, 150))
    bins = token_bins(lengths, budget)
    assert bins == token_bins(list(lengths), budget)  # deterministic: the lengths alone decide
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= budget for b in bins)
    assert all(b == sorted(b) and b for b in bins)
    # Few bins: within one of the lower bound here (LPT into k bins, k grown only when a row fits nowhere).
    assert len(bins) <= -(-sum(lengths) // budget) + 1


@pytest.mark.unit
def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    assert token_bins([5, 30, 7, 25, 6], 20) == [[1], [3], [0, 2, 4]]
    assert token_bins([50], 10) == [[0]]
    assert token_bins([], 10) == []
    with pytest.raises(ValueError, match="budget must be >= 1"):
        token_bins([3], 0)


@pytest.mark.unit
def test_token_bins_balance_the_loads():
    assert token_bins([10] * 8, 40) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # equal rows alternate
    lengths = [30, 28, 5, 4, 3, 3, 2, 1]
    bins = token_bins(lengths, 50)
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [38, 38]  # first fit: 50 + 26


@pytest.mark.unit
def test_row_groups_without_a_budget_are_length_sorted_chunks():
    lengths = np.array([7, 3, 9, 3, 1])
    assert [g.tolist() for g in row_groups(lengths, 2)] == [[4, 1], [3, 0], [2]]
    assert [g.tolist() for g in row_groups(lengths, 2, by_length=False)] == [[0, 1], [2, 3], [4]]
    assert [g.tolist() for g in row_groups(lengths, 2, max_tokens=12)] == [[2, 3], [0, 1, 4]]


# ------------------------------------------------------------------------ the packed forward


def ragged_batch(pad_id, seed=0, vocab=1024):
    rng = np.random.default_rng(seed)
    rollouts = [Rollout(prompt_ids=rng.integers(2, vocab, p), response_ids=rng.integers(2, vocab, r),
                        behaviour_logprobs=np.zeros(r, np.float32), finish_reason="stop", policy_version=0,
                        prompt_index=i, sample_index=0) for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))]
    return collate(rollouts, pad_id)


@pytest.mark.unit
def test_pack_lays_the_rows_end_to_end_with_positions_restarting(pad_id):
    b = ragged_batch(pad_id)
    p = pack(b)
    lengths = [a + r for a, r in zip(PROMPTS, RESPONSES)]
    assert p.input_ids.shape == p.position_ids.shape == (1, sum(lengths))
    assert p.position_ids[0].tolist() == [t for n in lengths for t in range(n)]
    starts = np.cumsum([0] + lengths)
    for i, (a, r) in enumerate(zip(PROMPTS, RESPONSES)):
        row = b.input_ids[i][b.attention_mask[i].bool()]
        assert torch.equal(p.input_ids[0, starts[i]:starts[i + 1]], row)
        # Each response token is predicted by the packed position just before it.
        mine = p.rows == i
        assert p.positions[mine].tolist() == list(range(starts[i] + a - 1, starts[i] + a + r - 1))
    assert torch.equal(p.tokens, b.response_ids[b.response_mask.bool()][None])
    assert torch.equal(p.scatter(p.select(b.response_mask)), b.response_mask)


def models(policy_path, reward_path):
    torch.manual_seed(0)
    out = {c: PolicyWithValueHead.from_pretrained(policy_path, critic=c, critic_model=reward_path).eval()
           for c in ("shared", "separate", "none")}
    torch.nn.init.normal_(out["shared"].value_head.weight, std=0.1)  # zero at init: values would agree trivially
    return out


def both(model, b, **kw):
    """(padded outputs, packed outputs) of one forward call."""
    p = pack(b)
    with torch.no_grad():
        padded = model(b.input_ids, b.attention_mask, b.position_ids, prompt_len=b.prompt_len,
                       kept_ids=b.kept_ids, **kw)
        packed = model(p.input_ids, None, p.position_ids, packed=p, kept_ids=b.kept_ids, **kw)
    return padded, packed


def gap(x, y, mask) -> float:
    finite = torch.isfinite(x) & (mask != 0)
    assert torch.equal(finite, torch.isfinite(y) & (mask != 0))  # -inf outside an own kept set, alike
    return float((x - y)[finite].abs().max())


@pytest.mark.unit
def test_packed_forward_gives_the_padded_outputs(policy_path, reward_path, pad_id):
    b = ragged_batch(pad_id)
    m = b.response_mask
    rng = np.random.default_rng(1)  # the sampler's kept sets: the token and a few others, -1 padded
    kept = torch.as_tensor(rng.integers(2, 1024, (*m.shape, 6)))
    kept[..., 0], kept[..., 4:] = b.response_ids, -1
    for critic, model in models(policy_path, reward_path).items():
        for sets, kw in ((kept, dict(temperature=0.7, with_own_set=True)),  # the sampler's sets, and its own
                         (None, dict(top_k=20, top_p=0.9, with_own_set=True)),
                         (None, dict(with_entropy=False)), (None, dict(values_only=True))):
            padded, packed = both(model, dataclasses.replace(b, kept_ids=sets), **kw)
            assert len(padded) == len(packed)
            for x, y in zip(padded, packed):
                assert (x is None) == (y is None)
                if x is not None:
                    assert x.shape == y.shape == m.shape
                    assert gap(x, y, m) < TOL, (critic, kw)
                    assert float(y[m == 0].abs().max()) == 0.0  # no token there: zeros
        values = both(model, b, values_only=True)[1][1]
        assert (float(values.abs().max()) > 0.01) is (critic != "none")


@pytest.mark.unit
def test_in_float64_the_packed_log_probs_are_the_padded_ones_to_rounding(policy_path, pad_id):
    """fp32 leaves ~1e-7 between the two (other shapes, other summation orders), which a few
    SGD steps at a large learning rate can grow past 1e-5; in float64 nothing is left."""
    model = PolicyWithValueHead.from_pretrained(policy_path, critic="none").double().eval()
    b = ragged_batch(pad_id)
    padded, packed = both(model, b, temperature=0.7)
    for x, y in (padded[0], packed[0]), (padded[2], packed[2]):
        assert x.dtype == torch.float64 and gap(x, y, b.response_mask) < 1e-12


@pytest.mark.unit
def test_packed_sequences_do_not_attend_to_each_other(policy_path, pad_id):
    """Changing one sequence's tokens leaves every other sequence's outputs bit-identical;
    the all-ones attention mask that would let them attend across does not."""
    model = PolicyWithValueHead.from_pretrained(policy_path).eval()
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    b = ragged_batch(pad_id)
    changed = b.input_ids.clone()
    changed[0, b.attention_mask[0].bool()] = torch.randint(2, 1024, (PROMPTS[0] + RESPONSES[0],))
    b2 = dataclasses.replace(b, input_ids=changed)
    p, p2 = pack(b), pack(b2)
    others = slice(1, None)
    with torch.no_grad():
        before = model(p.input_ids, None, p.position_ids, packed=p)
        after = model(p2.input_ids, None, p2.position_ids, packed=p2)
        assert not torch.equal(before[0][0], after[0][0])  # the changed sequence did change
        for x, y in zip(before, after):
            assert torch.equal(x[others], y[others])
        ones = torch.ones_like(p.input_ids)
        leaky = [model(q.input_ids, ones, q.position_ids, packed=q)[0] for q in (p, p2)]
    assert not torch.equal(leaky[0][others], leaky[1][others])  # the trap the packed forward avoids


@pytest.mark.unit
def test_a_packed_micro_batch_without_tokens_keeps_every_parameter_in_the_graph(policy_path, reward_path, pad_id):
    """A rank short of rows trains a blank micro-batch: zero loss, but every parameter must get
    a gradient (ZeRO's reductions line up), even when no response token is left to score."""
    b = ragged_batch(pad_id)[1:2]  # a one-token response
    every = models(policy_path, reward_path).values()
    for keep_token in (True, False):
        attention = b.attention_mask.clone()
        attention[:, b.prompt_len:] *= int(keep_token)
        blank = dataclasses.replace(b, response_mask=torch.zeros_like(b.response_mask), attention_mask=attention)
        for model in every:
            p = pack(blank)
            assert len(p.positions) == int(keep_token)
            lp, v, _ = model(p.input_ids, None, p.position_ids, packed=p)
            ((lp.sum() + v.sum()) * 0.0).backward()
            assert all(q.grad is not None and float(q.grad.abs().max()) == 0.0
                       for q in model.parameters() if q.requires_grad)
            model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------ the PPO update, packed vs padded


def ragged_rollouts(policy_path, n=8, seed=21, grouped=False):
    """``n`` rollouts with responses of 1 to 40 tokens and prompts of 2 to 12; ``grouped``:
    prompts of 4 samples each (the group estimators)."""
    rollouts = make_rollouts(policy_path, n, seed=seed, prompt_len=(2, 12), response_len=(1, 40))
    lengths = [r.response_ids.size for r in rollouts]
    assert max(lengths) >= 5 * min(lengths)
    if grouped:
        rollouts = [dataclasses.replace(r, chunk_id=0, prompt_index=i // 4) for i, r in enumerate(rollouts)]
    return rollouts


def config(*, packing, budget=0, stage=2, critic=None, reward_path=None, **ppo):
    """SGD (scale-sensitive), 2 epochs of 2 minibatches of 4 rows, shuffled (seeded)."""
    cfg = sgd_config(zero_stage=stage, packing=packing, max_tokens_per_micro_batch=budget, **ppo)
    return dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, shuffle=True), critic=critic,
                               critic_model=reward_path if critic == "separate" else None, max_new_tokens=48)


def update(policy_path, reward_path, rollouts, **options):
    cfg = config(reward_path=reward_path, **options)
    torch.manual_seed(0)
    w = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    # Packed rows attend per sequence (core/modeling/varlen_attention.py); padded ones keep sdpa.
    assert w.engine.module.lm.config._attn_implementation == (VARLEN if options["packing"] else "sdpa")
    before = w.full_state_dict()
    metrics = w.train(rollouts)
    after = w.full_state_dict()
    assert max_abs_diff(after, before) > 1e-2, "the update must move the weights measurably"
    return after, metrics


CASES = [  # (advantage, critic, agg, stage, token budget of the packed run)
    ("gae", None, "token-mean", 2, 0),
    ("gae", None, "seq-mean-token-mean", 2, 60),
    ("gae", None, "seq-mean-token-sum-norm", 3, 0),
    ("gae", "separate", "token-mean", 2, 60),
    ("grpo", None, "token-mean", 2, 60),
    ("rloo", None, "seq-mean-token-mean", 2, 0),
    ("reinforce_pp", None, "token-mean", 3, 60),
]


@pytest.mark.integration
@pytest.mark.parametrize("advantage, critic, agg, stage, budget", CASES)
def test_packed_update_trains_the_padded_weights(policy_path, reward_path, advantage, critic, agg, stage, budget):
    rollouts = ragged_rollouts(policy_path, grouped=advantage != "gae")
    kw = dict(advantage=advantage, critic=critic, agg=agg, stage=stage)
    padded, pm = update(policy_path, reward_path, rollouts, packing=False, **kw)
    packed, km = update(policy_path, reward_path, rollouts, packing=True, budget=budget, **kw)
    diff = max_abs_diff(packed, padded)
    print(f"{advantage}/{critic}/{agg} ZeRO-{stage} budget {budget}: max |packed - padded| = {diff:.1e}; padding "
          f"{pm['perf/learner_padding_frac']:.2f} -> {km['perf/learner_padding_frac']:.2f}")
    assert diff < TOL
    assert km["ppo/policy_loss"] == pytest.approx(pm["ppo/policy_loss"], abs=1e-5)
    assert km["perf/learner_padding_frac"] == 0.0 < pm["perf/learner_padding_frac"]
    assert km["learner/optimizer_steps"] == pm["learner/optimizer_steps"] == 4


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_two_ranks_with_token_budgets_train_one_padded_process_s_weights(ray_cluster, policy_path, stage):
    """Rank 0 holds the 4 longest rollouts (one over the budget), rank 1 the 4 shortest: with a
    token budget rank 0 cuts more micro-batches than rank 1, which runs blank ones to match. The
    global token-mean divisor spans both ranks: the weights are one padded process's."""
    rollouts = sorted(ragged_rollouts(policy_path, seed=20), key=lambda r: -r.prompt_ids.size - r.response_ids.size)
    lengths = np.array([r.prompt_ids.size + r.response_ids.size for r in rollouts])

    def cuts(rank, epoch):  # the micro-batches a rank cuts in each minibatch of an epoch
        plan = minibatch_plan([4, 4], rank, visit_order(8, seed=0, step=0, epoch=epoch, shuffle=True), 4, 2)
        return [len(row_groups(lengths[4 * rank + rows], 2, 40)) for rows, _ in plan]
    assert any(cuts(0, e) != cuts(1, e) for e in (0, 1))  # so a rank runs blank micro-batches
    expected, _ = update(policy_path, None, rollouts, packing=False, stage=stage)
    cfg = config(packing=True, budget=40, stage=stage)
    group = LearnerGroup(model=policy_path, config=cfg, world_size=2, num_cpus_per_rank=1,
                         name_prefix=f"packed-z{stage}")
    try:
        metrics = group.train(shard_rollouts(rollouts, 2))
        diff = max_abs_diff(group.state_dict(), expected)
        if stage < 3:  # rank 0 scores alone (reference.on_learner): no collective may wait for rank 1
            import ray
            alone = ray.get(group.workers[0].evaluate.remote(rollouts), timeout=120)
            together = group.evaluate(shard_rollouts(rollouts, 2))
    finally:
        group.shutdown()
    print(f"2 ranks packed ZeRO-{stage}: max |w - w_padded_1_rank| = {diff:.1e}")
    assert diff < TOL and metrics["learner/optimizer_steps"] == 4
    if stage < 3:
        assert max(float(np.abs(a - b).max()) for a, b in zip(alone, together)) < 1e-6

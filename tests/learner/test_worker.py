"""LearnerWorker / LearnerGroup on real DeepSpeed (CPU, gloo), 1 rank in-process and 2 ranks on Ray.

The central check: one PPO update with DeepSpeed (ZeRO-2/3, 1 or 2 ranks, micro-batch
gradient accumulation, global token-mean, global advantage whitening) gives the same
weights as a plain single-process torch implementation of the same update. SGD keeps it
scale-sensitive (Adam would hide a wrong gradient scale).
"""
import dataclasses

import numpy as np
import pytest
from helpers import make_rollouts, max_abs_diff, model_logprobs, reference_update, sgd_config

from core.kl import KLPenalty
from core.rollout import shard_rollouts
from learner.config import LearnerConfig, OptimConfig, PPOConfig
from learner.group import LearnerGroup
from learner.policy import PolicyWithValueHead
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration

TOL = 1e-5  # max abs weight difference vs the reference (measured ~4e-7)
METRIC_KEYS = ("ppo/policy_loss", "ppo/value_loss", "ppo/entropy", "ppo/approx_kl", "ppo/clip_frac",
               "ppo/vf_clip_frac", "ppo/grad_norm", "ppo/explained_variance", "ppo/lr",
               "ppo/logprob_gap_max", "ppo/logprob_gap_mean", "perf/learner_seconds",
               "perf/learner_tokens_per_s")


@pytest.fixture(scope="module")
def rollouts(policy_path):
    return make_rollouts(policy_path, 8, seed=1)


@pytest.fixture(scope="module")
def initial(policy_path):
    return {k: v.detach().clone() for k, v in PolicyWithValueHead.from_pretrained(policy_path).named_parameters()}


@pytest.fixture(scope="module")
def references(policy_path, rollouts, pad_id):
    """Reference updates per config key, computed once."""
    cache = {}

    def get(cfg):
        key = repr(cfg.ppo) + repr(cfg.optim)
        if key not in cache:
            cache[key] = reference_update(policy_path, rollouts, cfg, pad_id)
        return cache[key]
    return get


def worker(policy_path, cfg):
    return LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)


def check_against_reference(new, metrics, initial, ref, label):
    ref_weights, ref_norms = ref
    diff, moved = max_abs_diff(new, ref_weights), max_abs_diff(initial, ref_weights)
    norm_gap = abs(metrics["ppo/grad_norm"] - float(np.mean(ref_norms)))
    print(f"{label}: max |w - w_ref| = {diff:.2e} (tolerance {TOL:.0e}); weights moved {moved:.3f}; "
          f"grad-norm gap {norm_gap:.2e}")
    assert moved > 1e-2, "the update must move the weights measurably"
    assert diff < TOL, f"{label}: max abs diff {diff:.2e} >= {TOL:.0e}"
    assert norm_gap < 1e-4 * max(ref_norms)


# ------------------------------------------------------------------------ one rank, in-process


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_rank_update_matches_plain_torch(policy_path, rollouts, initial, references, stage):
    cfg = sgd_config(zero_stage=stage)  # 2 minibatches x 2 epochs x 2 micro-batches
    w = worker(policy_path, cfg)
    metrics = w.train(rollouts)
    check_against_reference(w.full_state_dict(), metrics, initial, references(cfg), f"1 rank ZeRO-{stage}")
    assert set(METRIC_KEYS) <= set(metrics)
    assert metrics["learner/optimizer_steps"] == 4 and metrics["ppo/lr"] == cfg.optim.lr
    assert metrics["ppo/logprob_gap_max"] < 1e-4  # behaviour logprobs came from the same weights
    assert "ppo/score_mean" not in metrics  # the driver reports reward/mean
    # Alone, a stage-0 rank skips DeepSpeed's gradient all-reduce (nothing to average); the
    # match with the reference shows gradients still accumulate over micro-batches.
    assert w.engine.enable_backward_allreduce is (stage != 0)
    assert w.health() == {**w.health(), "ok": True, "built": True, "step": 1, "optimizer_steps": 4}


def test_sum_norm_divides_by_the_generation_budget_whatever_the_batch(policy_path, rollouts, initial, references):
    """seq-mean-token-sum-norm (Dr. GRPO) divides each row's token sum by the constant budget, not by
    the step's longest response (<= 10 tokens here): the same row weighs the same in any batch."""
    cfg = dataclasses.replace(sgd_config(zero_stage=2, agg="seq-mean-token-sum-norm"), max_new_tokens=40)
    w = worker(policy_path, cfg)
    metrics = w.train(rollouts)
    check_against_reference(w.full_state_dict(), metrics, initial, references(cfg), "sum-norm, budget 40")


@pytest.mark.parametrize("options", [{"dtype": "bfloat16", "zero_stage": 2}, {"dtype": "bfloat16", "zero_stage": 3},
                                     {"critic": "separate", "zero_stage": 3}])
def test_bf16_and_separate_critic_train_every_part(policy_path, reward_path, rollouts, options):
    if options.get("critic") == "separate":
        options = {**options, "critic_model": reward_path}
    cfg = LearnerConfig(optim=OptimConfig(lr=1e-3), ppo=PPOConfig(ppo_epochs=2, minibatch_size=4,
                                                                  micro_batch_size=2), **options)
    w = worker(policy_path, cfg)
    before = w.full_state_dict()
    metrics = [w.train(rollouts) for _ in range(2)]
    # bf16: the module computes in bf16 (and pushes bf16 tensors), the optimizer steps fp32 master weights
    dtype = options.get("dtype", "float32")
    health = w.health()
    assert (health["dtype"], health["master_dtype"]) == (dtype, "float32")
    assert {str(t.dtype) for t in w.full_state_dict().values()} == {f"torch.{dtype}"}
    after = w.full_state_dict()
    parts = {k.split(".")[0] for k in after}
    assert parts == ({"lm", "critic_body", "value_head"} if "critic" in options else {"lm", "value_head"})
    for part in parts:
        assert max(float((after[k].float() - before[k].float()).abs().max()) for k in after
                   if k.startswith(part + ".")) > 1e-4, part
    assert all(np.isfinite(m[k]) for m in metrics for k in METRIC_KEYS)
    if "critic" in options:  # the critic starts from the reward model's head: not a zero value function
        assert metrics[0]["ppo/explained_variance"] != 0.0


@pytest.fixture(scope="module")
def stale_rollouts(rollouts):
    """The same tokens as if an older policy had sampled them: behaviour log-probs moved by
    N(0, 0.6) per token, so pi_learner / pi_behaviour spreads around 1 and some exceed 2."""
    rng = np.random.default_rng(7)
    return [dataclasses.replace(r, behaviour_logprobs=(r.behaviour_logprobs + rng.normal(
        0, 0.6, r.behaviour_logprobs.shape)).astype(np.float32)) for r in rollouts]


@pytest.mark.parametrize("mode, stage", [("tis", 2), ("decoupled", 3)])
def test_off_policy_correction_matches_plain_torch(policy_path, pad_id, stale_rollouts, initial, mode, stage):
    cfg = sgd_config(zero_stage=stage, off_policy=mode, is_cap=2.0)
    w = worker(policy_path, cfg)
    metrics = w.train(stale_rollouts)
    check_against_reference(w.full_state_dict(), metrics, initial,
                            reference_update(policy_path, stale_rollouts, cfg, pad_id), f"off_policy={mode}")
    # The mismatch metrics, by hand from the learner's own log-probs before the update.
    learner = model_logprobs(policy_path, [r.prompt_ids for r in stale_rollouts],
                             [r.response_ids for r in stale_rollouts])
    log_w = np.concatenate([a - r.behaviour_logprobs for a, r in zip(learner, stale_rollouts)]).astype(np.float64)
    weight = np.exp(log_w)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(weight.max(), rel=1e-4)
    assert metrics["off_policy/is_weight_mean"] == pytest.approx(weight.mean(), rel=1e-4)
    assert metrics["off_policy/capped_frac"] == pytest.approx(float((weight > 2.0).mean()), abs=1e-9)
    assert metrics["off_policy/behaviour_kl"] == pytest.approx(float((weight - 1 - log_w).mean()), rel=1e-3)
    assert 0 < metrics["off_policy/capped_frac"] < 0.5
    # The correction changes the update: the uncorrected one lands elsewhere.
    uncorrected, _ = reference_update(policy_path, stale_rollouts, sgd_config(zero_stage=stage, off_policy="none"),
                                      pad_id)
    assert max_abs_diff(w.full_state_dict(), uncorrected) > 1e-3


def _preset_fractions(log_w_rows, preset):
    """(truncated, masked) token fractions of ``preset`` at its default band and cap 2, by hand
    in numpy from each row's [R] log-weights."""
    n = sum(len(r) for r in log_w_rows)
    if preset == "seq_mis":  # a row is rejected when W = prod w is outside [0.5, 2]
        out = [len(r) for r in log_w_rows if not 0.5 <= np.exp(r.sum()) <= 2.0]
        return 0.0, sum(out) / n
    # icepop: a token is masked outside [0.5, 5]; nothing truncated
    return 0.0, sum(int(((np.exp(r) < 0.5) | (np.exp(r) > 5.0)).sum()) for r in log_w_rows) / n


@pytest.mark.parametrize("preset, loss", [("seq_mis", "gspo"), ("icepop", "cispo")])
def test_sequence_presets_and_policy_losses_train_and_report(policy_path, stale_rollouts, initial, preset, loss):
    """ppo.policy_loss=gspo/cispo with a masking preset: the update runs, moves the weights, and
    reports the fractions the preset masked, as computed by hand from the learner's log-probs."""
    clip = dict(clip_low=3e-4, clip_high=4e-4) if loss == "gspo" else {}
    cfg = sgd_config(off_policy=preset, policy_loss=loss, **clip)
    assert cfg.ppo.agg == ("seq-mean-token-mean" if loss == "gspo" else "token-mean")  # the loss's own
    w = worker(policy_path, cfg)
    metrics = w.train(stale_rollouts)
    learner = model_logprobs(policy_path, [r.prompt_ids for r in stale_rollouts],
                             [r.response_ids for r in stale_rollouts])
    log_w = [(a - r.behaviour_logprobs).astype(np.float64) for a, r in zip(learner, stale_rollouts)]
    truncated, masked = _preset_fractions(log_w, preset)
    assert metrics["off_policy/truncated_frac"] == pytest.approx(truncated, abs=1e-9)
    assert metrics["off_policy/masked_frac"] == pytest.approx(masked, abs=1e-9)
    assert 0 < metrics["off_policy/masked_frac"] < 1
    assert np.isfinite(metrics["ppo/policy_loss"]) and 0 <= metrics["ppo/clip_frac"] <= 1
    assert max_abs_diff(initial, w.full_state_dict()) > 1e-4


@pytest.mark.parametrize("estimator, stage", [("k3", 2), ("k2", 3)])
def test_kl_loss_term_matches_plain_torch(policy_path, pad_id, rollouts, initial, estimator, stage):
    """ppo.kl.placement=loss: beta x the estimator's aggregate joins the loss with its gradient
    through the policy's log-probs, exactly as the plain-torch update adds it."""
    cfg, kl = sgd_config(zero_stage=stage), KLPenalty(beta=0.5, estimator=estimator, placement="loss")
    w = worker(policy_path, cfg)
    metrics = w.train(rollouts, kl=kl)
    check_against_reference(w.full_state_dict(), metrics, initial,
                            reference_update(policy_path, rollouts, cfg, pad_id, kl=kl), f"KL loss {estimator}")
    without, _ = reference_update(policy_path, rollouts, sgd_config(zero_stage=stage), pad_id)
    assert max_abs_diff(w.full_state_dict(), without) > 1e-3  # the term moves the update
    assert metrics["ppo/kl_loss_token_mean"] > 0 and "ppo/kl_loss" in metrics


@pytest.fixture(scope="module")
def truncated_rollouts(policy_path, rollouts):
    """As a stale top_p=0.9 sampler would record them: each position's kept set is the policy's
    own nucleus plus the token (the tokens are random, so some lie outside the policy's own
    nucleus: their off-policy weight must be 0), behaviour log-probs renormalised over it and
    moved by N(0, 0.3), as an older version's would be."""
    import torch
    from transformers import AutoModelForCausalLM

    from core.sampling import kept_logprobs, kept_tokens

    lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    rng, out = np.random.default_rng(11), []
    for r in rollouts:
        ids = torch.as_tensor(np.concatenate([r.prompt_ids, r.response_ids]))[None]
        with torch.no_grad():
            logits = lm(ids).logits[0, r.prompt_ids.size - 1:-1]
        tokens = torch.as_tensor(r.response_ids)
        keep = kept_tokens(logits, 0, 0.9)
        keep[torch.arange(tokens.numel()), tokens] = True
        width = int(keep.sum(-1).max())
        kept = torch.full((tokens.numel(), width), -1, dtype=torch.long)
        for t in range(tokens.numel()):
            row = keep[t].nonzero().flatten()
            kept[t, :row.numel()] = row
        behaviour = kept_logprobs(logits[None], tokens[None], kept[None])[0].numpy()
        behaviour = (behaviour + rng.normal(0, 0.3, behaviour.shape)).astype(np.float32)
        out.append(dataclasses.replace(r, behaviour_logprobs=behaviour, kept_ids=kept.numpy()))
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_truncated_sampling_update_matches_plain_torch(policy_path, pad_id, truncated_rollouts, initial, stage):
    """Top-p rollouts: the ratio and entropy renormalise over the sampler's kept sets (trimmed
    and micro-batched with the rows), and a token outside the policy's own nucleus gets
    off-policy weight exactly 0 (the weights' mean, by hand, counts those tokens as 0)."""
    import torch

    from core.sampling import truncated_logprobs

    cfg = dataclasses.replace(sgd_config(zero_stage=stage, off_policy="tis", is_cap=2.0), top_p=0.9)
    w = worker(policy_path, cfg)
    metrics = w.train(truncated_rollouts)
    check_against_reference(w.full_state_dict(), metrics, initial,
                            reference_update(policy_path, truncated_rollouts, cfg, pad_id), f"top_p ZeRO-{stage}")
    from transformers import AutoModelForCausalLM
    lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    weights = []
    for r in truncated_rollouts:
        ids = torch.as_tensor(np.concatenate([r.prompt_ids, r.response_ids]))[None]
        with torch.no_grad():
            logits = lm(ids).logits[0, r.prompt_ids.size - 1:-1]
        own = truncated_logprobs(logits[None], torch.as_tensor(r.response_ids)[None], 0, 0.9)[0].double()
        weights.append(torch.exp(own - torch.as_tensor(r.behaviour_logprobs).double()).numpy())
    weights = np.concatenate(weights)
    assert 0 < float((weights == 0).mean()) < 1  # some tokens lie outside the policy's nucleus
    assert metrics["off_policy/is_weight_mean"] == pytest.approx(float(weights.mean()), rel=1e-4)


def test_behaviour_old_logprobs_match_plain_torch_and_probe_the_first_minibatch(policy_path, pad_id,
                                                                                stale_rollouts, initial):
    # No shuffle: minibatch 0 is rows 0-3. lr 0.1, not 0.5: against stale log-probs the ratios start
    # far from 1, and at 0.5 both sides agree to 1e-7 for two steps but part (1.1) after the third.
    cfg = sgd_config(zero_stage=0, lr=0.1, old_logprobs="behaviour")
    w = worker(policy_path, cfg)
    metrics = w.train(stale_rollouts)
    check_against_reference(w.full_state_dict(), metrics, initial,
                            reference_update(policy_path, stale_rollouts, cfg, pad_id), "old_logprobs=behaviour")
    recomputed, _ = reference_update(policy_path, stale_rollouts, sgd_config(zero_stage=0, lr=0.1), pad_id)
    assert max_abs_diff(w.full_state_dict(), recomputed) > 1e-2  # pi_old really is the sampler's (0.047)
    # The gap and importance-weight metrics come from the first minibatch's forward, before its step.
    first = stale_rollouts[:cfg.ppo.minibatch_size]
    learner = model_logprobs(policy_path, [r.prompt_ids for r in first], [r.response_ids for r in first])
    log_w = np.concatenate([a - r.behaviour_logprobs for a, r in zip(learner, first)]).astype(np.float64)
    assert metrics["ppo/logprob_gap_max"] == pytest.approx(np.abs(log_w).max(), rel=1e-4)
    assert metrics["ppo/logprob_gap_mean"] == pytest.approx(np.abs(log_w).mean(), rel=1e-4)
    assert metrics["off_policy/is_weight_mean"] == pytest.approx(np.exp(log_w).mean(), rel=1e-4)


def test_behaviour_old_logprobs_skip_the_policy_body_with_a_separate_critic(policy_path, reward_path, rollouts):
    """The recompute runs the critic alone: the policy body runs only in the epochs, and
    the old values are those of the full forward."""
    def run(mode):
        cfg = LearnerConfig(zero_stage=0, critic="separate", critic_model=reward_path, optim=OptimConfig(lr=1e-4),
                            ppo=PPOConfig(ppo_epochs=1, minibatch_size=8, micro_batch_size=4, old_logprobs=mode))
        w = worker(policy_path, cfg)
        calls = []
        w.engine.module.lm.model.register_forward_hook(lambda *a: calls.append(1))
        return w.train(rollouts), len(calls)

    recomputed, recompute_calls = run("recompute")
    behaviour, behaviour_calls = run("behaviour")
    assert (recompute_calls, behaviour_calls) == (4, 2)  # 2 micro-batches of prepare + 2 of the epoch
    assert behaviour["ppo/values_mean"] == pytest.approx(recomputed["ppo/values_mean"], rel=1e-6)
    assert behaviour["ppo/explained_variance"] == pytest.approx(recomputed["ppo/explained_variance"], rel=1e-6)
    assert behaviour["ppo/logprob_gap_max"] < 1e-4  # these behaviour log-probs came from the same weights


def test_loss_falls_and_clip_fraction_rises_over_epochs(policy_path, rollouts):
    cfg = LearnerConfig(optim=OptimConfig(lr=5e-5), ppo=PPOConfig(ppo_epochs=5, minibatch_size=8,
                                                                  micro_batch_size=4, vf_coef=0.5))
    w = worker(policy_path, cfg)
    w.train(rollouts)
    hist = w.objective.epoch_history
    total = [h["policy_loss"] + 0.5 * h["value_loss"] for h in hist]
    clip = [h["clip_frac"] for h in hist]
    print("loss per epoch", np.round(total, 4), "clip frac per epoch", np.round(clip, 3))
    assert all(later < earlier for earlier, later in zip(total, total[1:]))
    assert clip[0] == 0 and all(later >= earlier for earlier, later in zip(clip, clip[1:])) and clip[-1] > 0.3


def test_value_head_trains_explained_variance_rises(policy_path, rollouts):
    cfg = LearnerConfig(optim=OptimConfig(lr=3e-3), ppo=PPOConfig(ppo_epochs=2, minibatch_size=8,
                                                                  micro_batch_size=8, vf_coef=1.0))
    w = worker(policy_path, cfg)
    ev = [w.train(rollouts)["ppo/explained_variance"] for _ in range(5)]
    print("explained variance per update", np.round(ev, 3))
    assert ev[0] == pytest.approx(0.0, abs=1e-6)  # zero-init value head
    assert ev[-1] > ev[0] + 0.2


def test_ptx_loss_falls(policy_path, rollouts):
    from cluster.data.ptx import pack, tokenize
    from cluster.demo.sentiment import corpus
    rows = pack(tokenize(corpus(40, seed=5), policy_path), 24)[:6]  # 6 packed rows, 3 per optimizer step
    cfg = LearnerConfig(optim=OptimConfig(lr=3e-3), ppo=PPOConfig(minibatch_size=4, micro_batch_size=2,
                                                                  ptx_coef=1.0))
    w = worker(policy_path, cfg)
    losses = [w.train(rollouts, ptx_rows=rows)["ppo/ptx_loss"] for _ in range(4)]
    print("ptx LM loss per update", np.round(losses, 3))
    assert np.array_equal(w.objective.last_ptx_rows, rows)  # the rows arrived as rows, not flattened or transposed
    assert losses[-1] < losses[0] - 0.1


def test_reference_logprobs_bit_identical_across_a_learner_step(policy_path, rollouts):
    from actors.reference import Reference

    ref = Reference(model=policy_path)
    prompts, responses = [r.prompt_ids for r in rollouts], [r.response_ids for r in rollouts]
    before = ref.logprobs(prompts, responses)
    w = worker(policy_path, sgd_config(lr=1.0))
    policy_before = w.evaluate(rollouts)
    w.train(rollouts)
    after = ref.logprobs(prompts, responses)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(w.evaluate(rollouts), policy_before))
    assert moved > 1e-2  # the policy did change ...
    for a, b in zip(before, after):
        assert np.array_equal(a, b)  # ... the reference did not, to the bit


def test_save_load_continue_equals_never_stopping(policy_path, rollouts, tmp_path):
    # AdamW + warm-up/decay: optimizer moments and the scheduler must both be restored.
    cfg = LearnerConfig(zero_stage=3, optim=OptimConfig(lr=1e-3, warmup_steps=2, total_steps=10),
                        ppo=PPOConfig(ppo_epochs=2, minibatch_size=4, micro_batch_size=2))
    second = make_rollouts(policy_path, 8, seed=2)
    a = worker(policy_path, cfg)
    a.train(rollouts)
    a.save(tmp_path / "ckpt")
    expected = a.train(second)
    b = worker(policy_path, cfg)
    assert b.load(tmp_path / "ckpt") == 1
    # The HF export written with the checkpoint (gathered from ZeRO-3) is the restored policy.
    hf = model_logprobs(str(tmp_path / "ckpt" / "policy"), [r.prompt_ids for r in second],
                        [r.response_ids for r in second])
    assert max(float(np.abs(x - y).max()) for x, y in zip(hf, b.evaluate(second))) < 1e-5
    got = b.train(second)
    diff = max_abs_diff(a.full_state_dict(), b.full_state_dict())
    print(f"resume vs uninterrupted: max abs weight diff {diff:.1e}")
    assert diff == 0.0 and got["ppo/lr"] == expected["ppo/lr"] and got["ppo/policy_loss"] == expected["ppo/policy_loss"]
    assert (tmp_path / "ckpt" / "policy" / "config.json").is_file()
    fresh = worker(policy_path, cfg)
    fresh.train(second)
    assert max_abs_diff(fresh.full_state_dict(), b.full_state_dict()) > 1e-4  # loading mattered


def test_bad_inputs_raise_one_line_value_errors(policy_path, rollouts):
    empty = make_rollouts(policy_path, 2, seed=4, empty=(0, 1))
    w = worker(policy_path, sgd_config(minibatch=2, micro=2))
    with pytest.raises(ValueError, match="zero valid response tokens"):
        w.train(empty)
    # A dict config is validated for this world size; a LearnerConfig is taken as validated.
    with pytest.raises(ValueError, match=r"minibatch_size=6 is not divisible by .*micro_batch_size=1\*4"):
        worker(policy_path, {"ppo": {"minibatch_size": 6, "micro_batch_size": 4}})
    with pytest.raises(ValueError, match=r"zero_stage=5 is out of range"):
        worker(policy_path, {"zero_stage": 5})
    with pytest.raises(ValueError, match="2 ranks start through LearnerGroup"):
        LearnerWorker(rank=0, world_size=2, model=policy_path, config=sgd_config())


# ------------------------------------------------------------------------ two ranks on Ray


@pytest.fixture(scope="module")
def groups(ray_cluster, policy_path):
    """get(stage): the module's 2-rank group at ZeRO ``stage`` (2 and 3), both started here so
    that the tests share them (nothing a test starts outlives it: tests/conftest.py)."""
    made = {stage: LearnerGroup(model=policy_path, config=sgd_config(zero_stage=stage), world_size=2,
                                num_cpus_per_rank=1, name_prefix=f"learner-z{stage}") for stage in (2, 3)}
    yield made.__getitem__
    for g in made.values():
        g.shutdown()


@pytest.mark.parametrize("stage, by_reference", [(2, False), (3, True)])
def test_two_ranks_update_matches_plain_torch(groups, policy_path, pad_id, rollouts, initial, references, stage,
                                              by_reference):
    import ray
    group = groups(stage)
    # The group's weights as this test finds them: the initial ones, or (in another test order)
    # those an earlier test trained, which the reference then updates from.
    start = group.state_dict()
    ref = references(group.config) if max_abs_diff(start, initial) == 0 else \
        reference_update(policy_path, rollouts, group.config, pad_id, start=start)
    shards = shard_rollouts(rollouts, 2)
    if by_reference:  # what the buffer hands over: each rank resolves its own shard
        shards = [ray.put(s) for s in shards]
    metrics = group.train(shards)
    check_against_reference(group.state_dict(), metrics, start, ref, f"2 ranks ZeRO-{stage}")
    assert set(METRIC_KEYS) <= set(metrics) and "learner/dropped_rollouts" not in metrics
    # Each rank pulls a shard handed by reference (core.infra.transfer): one node, so nothing crossed.
    assert metrics["transfer/to_learner_bytes"] == 0 and metrics["transfer/to_learner_seconds"] == 0.0
    assert (metrics["transfer/to_learner_local_bytes"] > 0) is by_reference  # both ranks' shards, summed
    print(f"2 ranks ZeRO-{stage}: {metrics['perf/learner_seconds']:.3f} s/update, "
          f"{metrics['perf/learner_tokens_per_s']:.0f} tokens/s")


def test_two_rank_save_load_continue(groups, policy_path, tmp_path):
    group = groups(3)  # ZeRO-3: each rank restores its own partition
    second = make_rollouts(policy_path, 8, seed=2)
    group.train(shard_rollouts(make_rollouts(policy_path, 8, seed=3), 2))  # a step to save, in any test order
    group.save(tmp_path / "ckpt")
    group.train(shard_rollouts(second, 2))
    expected = group.state_dict()
    assert group.load(tmp_path / "ckpt") >= 1
    group.train(shard_rollouts(second, 2))
    assert max_abs_diff(group.state_dict(), expected) == 0.0


def test_two_rank_zero3_push_sends_the_gathered_lm(groups):
    import ray

    from core.infra.weights import WEIGHT_UPDATE_GROUP

    @ray.remote(num_cpus=0, concurrency_groups={WEIGHT_UPDATE_GROUP: 1})  # as actors.generator.actor_class
    class RecordingGenerator:  # defined here so Ray ships it by value (tests are not importable there)
        def load_weights(self, version, buckets):
            from safetensors.torch import load
            self.tensors = {k: v for b in buckets for k, v in load(b).items()}
            return {"version": version}

        def tensors_(self):
            return self.tensors

    group = groups(3)
    recorders = [RecordingGenerator.remote() for _ in range(2)]
    report = group.push_weights({"generator-0": recorders[0], "generator-1": recorders[1]}, version=7,
                                bucket_bytes=256 << 10)
    expected = {k[len("lm."):]: v for k, v in group.state_dict().items() if k.startswith("lm.")}
    for got in ray.get([r.tensors_.remote() for r in recorders]):
        assert "lm_head.weight" not in got  # tied to the embedding: sent once
        assert max_abs_diff(got, expected) == 0.0
    assert report["version"] == 7 and report["generators"] == 2 and report["buckets"] > 1


def test_group_errors_name_the_rank(groups, policy_path):
    import ray
    group = groups(2)
    with pytest.raises(ValueError, match=r"learner rank \d failed in train: .*zero valid response tokens"):
        group.train(shard_rollouts(make_rollouts(policy_path, 2, seed=4, empty=(0, 1)), 2))
    with pytest.raises(ValueError, match="got 1 shards for 2 ranks"):
        group.train([make_rollouts(policy_path, 2, seed=4)])
    with pytest.raises(ValueError, match="zero_stage=5"):
        LearnerGroup(model=policy_path, config={"zero_stage": 5}, world_size=2)
    with pytest.raises(ValueError, match=r"minibatch_size=4 is not divisible by world_size\*micro_batch_size=2\*4"):
        LearnerGroup(model=policy_path, config={"ppo": {"minibatch_size": 4, "micro_batch_size": 4}}, world_size=2)
    with pytest.raises(TypeError, match="generators must map replica id -> actor handle, got list"):
        group.push_weights([], version=1)
    dead = group.workers[1]
    ray.kill(dead)
    try:
        while True:  # the kill lands asynchronously (a call already queued may still succeed): until Ray says so
            try:
                ray.get(dead.health.remote())
            except ray.exceptions.RayActorError:
                break
        with pytest.raises(RuntimeError, match="learner rank 1 died during health"):
            group.health()
    finally:
        group.restart()  # the shared group whole again (its initial weights) for the tests after this one

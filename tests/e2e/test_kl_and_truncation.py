"""The KL in the loss, and top-k/top-p sampling, through the whole service (real Ray, vLLM, DeepSpeed)."""
import json

import pytest

from cluster import train

pytestmark = pytest.mark.e2e


def test_kl_in_the_loss_with_truncated_sampling(cluster, tmp_path):
    """ppo.kl.placement=loss with k3 and top_k/top_p sampling, in sync mode. The learner gets
    the step's beta and trains on the KL term; the kept sets travel
    with the rollouts, so the learner's log-probs of the sampled tokens (over the sampler's
    set) equal vLLM's and every off-policy weight is ~1 (a learner scoring its full softmax,
    or its own nucleus with the token forced in, misses by 0.1-2.6 nats here)."""
    argv = [f"run.dir={tmp_path}", "run.name=kl-loss", "run.steps=4", "run.eval_every=0", "model.dtype=float32",
            "ppo.kl.placement=loss", "ppo.kl.estimator=k3", "ppo.kl.target=null", "ppo.kl.beta=0.2",
            "generator.sampling.top_k=40", "generator.sampling.top_p=0.9"]
    assert train.main(argv) == 0
    run_dir = tmp_path / "kl-loss"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m["step"] > 0]
    assert len(steps) == 4
    for m in steps:
        assert m["ppo/kl_loss_coef"] == pytest.approx(m["kl/beta"])
        assert m["kl/beta"] == pytest.approx(0.2)
        assert m["ppo/kl_loss_token_mean"] >= 0 and m["kl/mean"] >= 0  # k3 is never negative
        assert m["ppo/logprob_gap_mean"] < 1e-3
        assert m["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert steps[-1]["ppo/kl_loss_token_mean"] > 0  # the policy moved off the reference


# The slow tier. The default tier: partial rollouts in tests/actors/test_partial_rollouts.py::
# test_push_lands_mid_generate_and_each_token_keeps_its_version, the off-policy correction in
# tests/learner/test_worker.py::test_off_policy_correction_matches_plain_torch.
@pytest.mark.slow
def test_async_trains_partial_rollouts_with_off_policy_weights(cluster, tmp_path):
    """Async mode with staleness 1, where generation is the bottleneck by a wide margin: the
    engine runs one sequence at a time and every response runs its full 16 tokens, so a batch
    takes several times the learner's step (the test holds while it takes more than one, on a
    machine several times faster or slower alike) and every push finds a generate call
    running. (With EOS allowed, responses of ~5 tokens made the two equal and pushes fell
    between calls on faster machines.) Weight pushes land mid-response, those rollouts are
    trained one version later with per-token behaviour log-probs of two versions, the
    off-policy weights move off 1, and the policy still learns."""
    argv = [f"run.dir={tmp_path}", "run.name=async-partial", "run.mode=async", "buffer.max_staleness=1",
            "generator.engine.max_num_seqs=1", "generator.sampling.ignore_eos=true", "run.steps=12",
            "run.eval_every=0", "model.dtype=float32"]
    assert train.main(argv) == 0
    run_dir = tmp_path / "async-partial"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m["step"] > 0]
    print([(m["step"], round(m["rollouts/partial_frac"], 3), round(m["off_policy/is_weight_mean"], 4),
            round(m["reward/mean"], 3)) for m in steps])
    assert max(m["rollouts/partial_frac"] for m in steps) > 0
    assert max(m["buffer/staleness_max"] for m in steps) == 1
    # Admission by version at staleness 1: a batch is issued only when it can still be trained
    # within one version of the weights that sample it, so none is dropped as stale.
    assert steps[-1]["buffer/dropped_stale"] == 0
    # The premise: generation outlasts the learner's step (by how much shows in the print).
    print("generate / learn seconds per step:", sum(m["perf/generate_seconds"] for m in steps)
          / sum(m["perf/learner_seconds"] for m in steps))
    assert max(abs(m["off_policy/is_weight_mean"] - 1) for m in steps) > 1e-3
    assert max(m["off_policy/behaviour_kl"] for m in steps) > 1e-5
    first = sum(m["reward/mean"] for m in steps[:3]) / 3
    last = sum(m["reward/mean"] for m in steps[-3:]) / 3
    assert last > first + 0.3

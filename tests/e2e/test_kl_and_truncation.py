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
    argv = [f"run.dir={tmp_path}", "run.name=kl-loss", "run.steps=4", "run.eval_every=0",
            "ppo.kl.placement=loss", "ppo.kl.estimator=k3", "ppo.kl.target=null", "ppo.kl.beta=0.2",
            "generator.sampling.top_k=40", "generator.sampling.top_p=0.9"]
    assert train.main(argv) == 0
    run_dir = tmp_path / "kl-loss"
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if m["step"] > 0]
    assert len(steps) == 4
    for m in steps:
        assert m["ppo/kl_loss_coef"] == pytest.approx(m["kl/beta"]) == pytest.approx(0.2)
        assert m["ppo/kl_loss_token_mean"] >= 0 and m["kl/mean"] >= 0  # k3 is never negative
        assert m["ppo/logprob_gap_mean"] < 1e-3
        assert m["off_policy/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert steps[-1]["ppo/kl_loss_token_mean"] > 0  # the policy moved off the reference

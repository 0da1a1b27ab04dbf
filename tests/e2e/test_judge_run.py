"""reward.judge end to end: a run whose reward is the tiny judge model's verdict, and a judge
replica killed mid-scoring, replaced like every pool's."""
import json

import pytest
import ray

from cluster import train
from cluster.config.ppo import DEFAULT_CONFIG

pytestmark = pytest.mark.e2e
JUDGE = ["reward.function=null", "reward.judge.model=builtin:judge", "model.dtype=bfloat16"]


def test_a_run_scored_by_the_judge_finishes_with_its_verdicts(cluster, tmp_path):
    argv = [f"run.dir={tmp_path}", "run.name=judge", "run.steps=2", "run.eval_every=0", "run.samples_every=1",
            "run.plot_every=0", "data.prompts_per_step=8", *JUDGE]
    assert train.main(argv) == 0
    run_dir = tmp_path / "judge"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "succeeded" and status["dtypes"]["reward-0"] == "bfloat16"  # the judge's engine
    steps = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [m["policy/version"] for m in steps] == [1, 2]
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    # The tiny judge writes " 0" or " 1" (cluster/demo/judge.py); the sentiment function's
    # scores are multiples of 1/words: the scores are the judge's verdicts.
    assert samples and {s["score"] for s in samples} <= {0.0, 1.0}
    assert all(m["rollouts/invalid_scores"] <= 2 for m in steps)
    # Verdicts of each pair, not one for all: the policy writes sentences of both sentiments (its
    # corpus mixes them evenly), and the judge tells them apart, so each step's 32 pairs (8 prompts,
    # 4 samples each) get both verdicts; a judge that scored every pair alike would show std 0 here.
    assert all(0 < m["reward/mean"] < 1 and m["reward/std"] > 0 for m in steps), \
        [(m["reward/mean"], m["reward/std"]) for m in steps]


@pytest.mark.slow  # two judge engines and a third for the replacement
def test_a_judge_replica_killed_while_scoring_is_replaced(cluster_with_test_rewards, tmp_path):
    from test_faults import Killer, assert_every_prompt_accounted, steps_until

    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.loop.ledger import ChunkState
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools
    from cluster.runtime.prepare import prepare

    cfg = load_config(DEFAULT_CONFIG, [*JUDGE, "run.eval_every=0", "run.samples_every=0", "reward.replicas=2"])
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    try:
        with RunMetrics(run_dir=tmp_path, plot_every=0) as metrics:
            driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                            metrics=metrics)
            rewards = driver.pools.rewards
            steps = steps_until(driver, Killer(driver, rewards, "reward-0", ChunkState.SCORING))
            for m in steps:
                assert_every_prompt_accounted(m)
            assert sum(m["rollouts/redispatched_chunks"] for m in steps) >= 1
            assert sorted(rewards.handles()) == ["reward-1", "reward-2"]
            # One generator chunk per sync step goes to the least-loaded replica, which need not be
            # the replacement: ask it directly, as a scoring call does.
            ids = [tokenizer(t, return_tensors="np")["input_ids"][0] for t in ("The cat was", " happy.")]
            res = ray.get(rewards.handles()["reward-2"].score.remote([ids[0]], [ids[1]]))
            assert res.valid.all() and res.scores.tolist() == [1.0]  # the judge's verdict
            assert ray.get(rewards.handles()["reward-2"].health.remote())["dtype"] == "bfloat16"
            driver.step()  # and the run goes on
    finally:
        pools.shutdown()

"""The whole service on CPU: real Ray, vLLM, DeepSpeed, tiny offline models."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

from cluster import train
from cluster.config.ppo import DEFAULT_CONFIG
from cluster.runtime.prepare import prepare, prepare_ptx

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def driver_loads(monkeypatch):
    """Counts Rollout / ScoredRollout objects unpickled in THIS process (the driver's).

    The patch lives only here: actors run in other processes, where loading rollouts is their job.
    """
    from core.rollout import Rollout

    count = {"rollouts": 0}

    def counting_setstate(self, state):
        count["rollouts"] += 1
        self.__dict__.update(state)

    monkeypatch.setattr(Rollout, "__setstate__", counting_setstate, raising=False)
    return count


def test_rollout_load_counter_sees_a_load(driver_loads):
    """The counter itself works: a rollout pickled and loaded here is counted."""
    import pickle

    import numpy as np

    from core.rollout import Rollout
    r = Rollout(prompt_ids=np.array([1]), response_ids=np.array([2]), behaviour_logprobs=np.array([-1.0]),
                finish_reason="stop", policy_version=0, prompt_index=0, sample_index=0)
    pickle.loads(pickle.dumps(r))
    assert driver_loads["rollouts"] == 1


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path, name, *overrides):
    argv = [f"run.dir={tmp_path}", f"run.name={name}", *overrides]
    assert train.main(argv) == 0
    run_dir = tmp_path / name
    assert json.loads((run_dir / "status.json").read_text())["state"] == "succeeded"
    return run_dir, [m for m in read_metrics(run_dir) if m["step"] > 0]


def test_sync_default_learns(cluster, tmp_path):
    """The default task in model.dtype=bfloat16, the precision users run where the CPU has it:
    every role computes in bf16 (as each reports it), the learner steps fp32 master weights, a
    push carries bf16 tensors, and the task learns. That the pushed weights serve exactly the
    learner's policy (log-prob gap < 1e-3, fp32) is held by tests/families/test_family_push.py::
    test_pushed_weights_serve_the_learners_policy; bf16's rounding alone exceeds that gap here."""
    run_dir, steps = run(tmp_path, "sync", "run.steps=8", "run.eval_every=4", "model.dtype=bfloat16",
                         "reward.gold=cluster.demo.sentiment:sentiment")
    assert [m["policy/version"] for m in steps] == list(range(1, 9))
    step0 = read_metrics(run_dir)[0]  # start-up is timed by phase, and the phases add up
    phases = [step0[f"perf/startup_{p}_seconds"] for p in ("imports", "prepare", "ray", "pools", "other")]
    assert step0["step"] == 0 and step0["perf/startup_pools_seconds"] > 1
    assert step0["perf/startup_seconds"] == pytest.approx(sum(phases), abs=0.05)
    # The gold function is scored at evaluation only, on the same held-out rollouts as the
    # reward (here the same function, so the same numbers), and the alarms report every step.
    evals = [m for m in read_metrics(run_dir) if "eval/gold_score" in m]
    assert [m["step"] for m in evals] == [0, 4, 8]
    assert all(m["eval/gold_score"] == pytest.approx(m["eval/score_mean"], abs=1e-6) for m in evals)
    assert all("alarm/kl_up_entropy_down" in m and "alarm/length_drift" in m for m in steps)
    for m in steps:  # every prompt of the step accounted for, on-policy
        assert m["rollouts/prompts"] == 16
        assert m["rollouts/used"] + 4 * (m["rollouts/skipped_prompts"]) \
            + m["rollouts/invalid_scores"] + m["rollouts/empty_responses"] == 16 * 4
        assert m["buffer/staleness_max"] == 0
    status = json.loads((run_dir / "status.json").read_text())
    assert status["dtypes"] == {"generator-0": "bfloat16", "reference-0": "bfloat16",
                                "learner-0": "bfloat16 (master weights float32)"}
    from learner.policy import PolicyWithValueHead
    lm = PolicyWithValueHead.from_pretrained(run_dir / "checkpoints" / "final").lm
    # tied head: the embedding is sent once (learner/transport/base.py); 2 bytes each, plus safetensors headers
    params = sum(p.numel() for p in lm.parameters())
    assert all(2 * params <= m["perf/sync_bytes"] < 2 * params + 65536 for m in steps), steps[0]["perf/sync_bytes"]
    gaps = [m["ppo/logprob_gap_mean"] for m in steps]
    assert all(1e-5 < g < 0.05 for g in gaps), gaps  # bf16 rounding shows, and stays small
    # generator.sampling.seed=data.seed=run.seed 0, 1, 2: reward first 3 -> last 3 steps +1.35, +1.11, +0.97;
    # eval at step 0 -> step 8 +1.31, +1.74, +1.71. Margins 0.5 and 0.6.
    first = sum(m["reward/mean"] for m in steps[:3]) / 3
    last = sum(m["reward/mean"] for m in steps[-3:]) / 3
    scores = [m["eval/score_mean"] for m in evals]
    print(f"reward first 3 steps {first:.3f} -> last 3 steps {last:.3f}; eval {scores}")
    assert last > first + 0.5 and scores[-1] > scores[0] + 0.6
    assert (run_dir / "checkpoints" / "final" / "config.json").exists()
    assert (run_dir / "config.yaml").exists() and (run_dir / "plots" / "reward.png").exists()


PTX_TEXTS = ["an old lighthouse keeper counted the gulls every morning",
             "the baker sold warm rye loaves before sunrise",
             "seven red kites circled over the frozen harbour"]


# The slow tier. The default tier: PTX in tests/learner/test_worker.py::test_ptx_loss_falls, truncated sampling in
# tests/e2e/test_kl_and_truncation.py::test_kl_in_the_loss_with_truncated_sampling, 2-replica pools in
# tests/e2e/test_scale.py::test_pools_scale_up_and_down_while_the_job_runs and 2 learner ranks in
# tests/e2e/test_critic_free_service.py::test_dynamic_sampling_trains_no_flat_prompt_and_refills_the_step.
@pytest.mark.slow
def test_scaled_pools_with_ptx_and_truncated_sampling(cluster, tmp_path, driver_loads):
    """Pools sized independently (2 generators, 1 reference, 2 rewards, 2 learner ranks),
    PPO-ptx from a user's text file, sampling with top-p and top-k: rollouts travel by
    reference only, each rank trains on its own rows of that text, the PTX loss falls, and
    behaviour, reference and learner score one truncated distribution (KL 0 at step 1)."""
    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools

    text = tmp_path / "ptx.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in PTX_TEXTS * 30))
    cfg = load_config(DEFAULT_CONFIG, [
        "run.eval_every=0", "run.samples_every=0", "run.plot_every=0", "run.steps=4", "learner.replicas=2",
        "generator.replicas=2", "reward.replicas=2",
        "ppo.ptx_coef=0.5", f"ptx.path={text}", "ptx.seq_len=24", "ptx.batch_size=4",
        "generator.sampling.top_p=0.9", "generator.sampling.top_k=50",
        "model.dtype=float32"])  # the KL of 1e-4 and the 1e-5 log-prob gaps below are fp32's
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    ptx = prepare_ptx(cfg, tokenizer_path)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    try:
        with RunMetrics(run_dir=tmp_path, plot_every=0) as metrics:
            driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                            metrics=metrics, ptx=ptx)
            steps = [driver.step() for _ in range(4)]
            ranks = [ray.get(ray.get_actor(f"learner-{r}").ptx_rows.remote()) for r in range(2)]
            assert sorted(pools.actor_names()) == sorted([  # looked up live in Ray
                "generator-0", "generator-1", "reference-0", "reward-0", "reward-1",
                "learner-0", "learner-1", "buffer-0"])
    finally:
        pools.shutdown()
    assert all(m["rollouts/used"] >= 60 for m in steps)
    # Rollouts went generator -> scorers -> buffer -> learner ranks by reference.
    assert driver_loads["rollouts"] == 0
    # Step 4's rows, as each rank received them: 2 epochs x 2 minibatches x 4 rows, split over 2 ranks.
    assert [r.shape for r in ranks] == [(8, 24), (8, 24)]
    assert np.array_equal(np.concatenate(ranks), driver.ptx.rows_for_step(3, 16))
    stream = tokenizer.eos_token.join(PTX_TEXTS * 30)
    for rank, rows in enumerate(ranks):
        decoded = [tokenizer.decode(row) for row in rows]
        print(f"rank {rank} PTX row: {decoded[0]!r}")
        assert all(d in stream + tokenizer.eos_token for d in decoded)
    losses = [m["ppo/ptx_loss"] for m in steps]
    print("ppo/ptx_loss per step", np.round(losses, 3), "kl/mean at step 1", steps[0]["kl/mean"],
          "logprob gaps", [f"{m['ppo/logprob_gap_mean']:.1e}" for m in steps])
    assert losses[-1] < losses[0] - 0.2
    assert abs(steps[0]["kl/mean"]) < 1e-4  # policy == reference: the truncated KL is 0
    assert all(m["ppo/logprob_gap_mean"] <= 1e-5 for m in steps)


@pytest.mark.slow  # tests/e2e/test_scale.py grows and shrinks pools of a running job through the CLI
def test_pools_change_while_running(cluster, tmp_path, driver_loads):
    """A generator joins mid-run with the current weights and serves; another leaves; nothing restarts."""
    from cluster.config.ppo import load_config
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import create_pools

    cfg = load_config(DEFAULT_CONFIG, ["run.eval_every=0", "run.samples_every=0",
                                       "model.dtype=float32"])  # the 1e-3 log-prob gap check below
    policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
    pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
    try:
        with RunMetrics(run_dir=tmp_path, plot_every=0) as metrics:
            driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                            metrics=metrics)
            health = lambda rid: ray.get(pools.generators.handles()[rid].health.remote())
            driver.step()
            added = driver.add_generator()
            assert added == "generator-1" and health(added)["version"] == 1  # weights before serving
            learner_before = ray.get(ray.get_actor("learner-0").health.remote())
            second = driver.step()
            assert health(added)["generated_tokens"] > 0  # least-loaded dispatch used it
            # Sync mode: what the new replica sampled matches the learner's weights.
            assert second["ppo/logprob_gap_mean"] < 1e-3
            pools.generators.remove("generator-0")
            with pytest.raises(ValueError):
                ray.get_actor("generator-0")
            served = health(added)["generated_tokens"]
            third = driver.step()
            assert health(added)["generated_tokens"] > served and third["policy/version"] == 3
            assert third["rollouts/used"] == 64 - 4 * third["rollouts/skipped_prompts"] \
                - third["rollouts/invalid_scores"] - third["rollouts/empty_responses"]
            # The learner and the scorers were never restarted.
            learner_after = ray.get(ray.get_actor("learner-0").health.remote())
            assert learner_after["step"] == learner_before["step"] + 2
    finally:
        pools.shutdown()
    assert driver_loads["rollouts"] == 0


def test_async_bounded_staleness(cluster, tmp_path, driver_loads):
    _, steps = run(tmp_path, "async", "run.mode=async", "buffer.max_staleness=0",
                   "run.steps=5", "run.eval_every=0", "model.dtype=float32")  # the 1e-3 gap check below
    assert [m["policy/version"] for m in steps] == list(range(1, 6))
    assert max(m["buffer/staleness_max"] for m in steps) == 0
    # The staleness above is computed from the generators' version tags; the logprob gap is
    # computed from the weights themselves. With no staleness allowed every trained rollout was
    # sampled by the learner's current weights, so a tag that lies about them shows here.
    assert all(m["ppo/logprob_gap_mean"] < 1e-3 for m in steps)
    assert all(m["off_policy/behaviour_kl"] < 1e-5 and m["off_policy/is_weight_max"] < 1.1 for m in steps)
    # Partial rollouts (on by default in async mode): a rollout a push reached mid-response is
    # as old as its first token, so none passes a zero staleness bound.
    assert all(m["rollouts/partial_frac"] == 0 and m["buffer/token_staleness_mean"] == 0 for m in steps)
    # Admission by version: with no staleness allowed, a batch issued while the learner trains
    # could only be dropped, so none is: the producer waits (and says so) instead.
    assert steps[-1]["buffer/dropped_stale"] == 0
    assert sum(m["perf/admission_wait_seconds"] for m in steps) > 0
    # Each step reports the generation work done while it waited; none of it is lost.
    assert sum(m["rollouts/prompts"] for m in steps) >= 5 * 16
    # A step whose batch went out during the previous one (a short take admits the next batch
    # at once) reports no generation of its own: rate and prompts agree either way.
    assert all((m["perf/tokens_per_s"] > 0) == (m["rollouts/prompts"] > 0) for m in steps)
    assert driver_loads["rollouts"] == 0


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "cluster.train", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=600, env={**os.environ, **(env or {})})


# The user-mistake cases (exit 2, one line) live in tests/cluster/job/test_cli_errors.py.


def test_empty_dataset_and_missing_fields(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"text": "no prompt field"}\n{"prompt": ""}\n')
    result = cli(f"run.dir={tmp_path / 'runs'}", f"data.path={data}")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "prompt" in result.stderr


# The slow tier: a job that waits out its placement timeout. The default tier: tests/cluster/runtime/pools/
# test_placement.py::test_no_node_with_the_label_fails_in_one_line_within_the_timeout.
@pytest.mark.slow
def test_unplaceable_pool_fails_fast_naming_the_pool(cluster, tmp_path, capsys):
    """On a Ray it joins (here this test's 8 CPUs) placement is Ray's: a pool that does not fit
    fails after resources.placement_timeout_s. A Ray of its own is sized to the machine before
    it starts (the refusals in tests/cluster/job/test_cli_errors.py)."""
    rc = train.main([f"run.dir={tmp_path}", "run.name=big", "generator.replicas=50",
                     "resources.placement_timeout_s=5"])
    assert rc == 2
    assert "pool generator: cannot place 50 replica(s)" in capsys.readouterr().err
    status = json.loads((tmp_path / "big" / "status.json").read_text())
    assert status["state"] == "failed" and "generator" in status["reason"]
    assert not (tmp_path / "big" / "checkpoints" / "final").exists()


# The slow tier: a full subprocess job. The default tier: tests/cluster/job/test_cli_errors.py::
# test_user_mistake_exits_2_with_one_line probes a user's reward module, tests/e2e/test_reward_failures.py::
# test_mostly_non_finite_scores_fail_the_run_naming_the_reward runs one in the reward actors.
@pytest.mark.slow
def test_local_reward_function_beside_the_config(tmp_path):
    """A user's `module:function` in the working directory works in the reward actors too."""
    (tmp_path / "my_reward.py").write_text(
        "def length(prompts, responses):\n    return [float(len(r)) for r in responses]\n")
    result = subprocess.run(
        [sys.executable, "-m", "cluster.train", "reward.function=my_reward:length",
         "run.steps=1", "run.eval_every=0", f"run.dir={tmp_path / 'runs'}", "run.name=local"],
        cwd=tmp_path, text=True, capture_output=True, timeout=600,
        env={**os.environ, "RAY_ADDRESS": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    [step] = [m for m in read_metrics(tmp_path / "runs" / "local") if m["step"] == 1]
    assert step["reward/mean"] > 1.0 and step["rollouts/invalid_scores"] == 0

"""The benchmark harness's cheap parts: workload prompts, pool CPU overrides, peak-memory sampler.
Nothing here is timed."""
import json
import subprocess
import sys

import pytest

from bench.procmem import PeakMemory
from bench.vs_trl import BenchError, parse_pool_cpus
from bench.workload import _prompts


@pytest.fixture(scope="module")
def bench_tokenizer():
    from transformers import AutoTokenizer

    from cluster.demo.tiny_models import SPEC_BENCH_32M, build_tokenizer
    return AutoTokenizer.from_pretrained(build_tokenizer(SPEC_BENCH_32M.vocab_size))


@pytest.mark.unit
def test_workload_prompts_are_seeded_fixed_length_and_round_trip(bench_tokenizer):
    a = _prompts(bench_tokenizer, 64, 16, seed=0)
    assert a == _prompts(bench_tokenizer, 64, 16, seed=0)
    assert a != _prompts(bench_tokenizer, 64, 16, seed=1)
    assert len({tuple(p) for p in a}) == 64 and all(len(p) == 16 for p in a)
    # tether tokenizes the text, TRL takes the ids: both must be the same prompt
    assert all(bench_tokenizer(bench_tokenizer.decode(p))["input_ids"] == p for p in a)


@pytest.mark.unit
def test_bench_model_has_the_issue_shape():
    from cluster.demo.tiny_models import SPEC_BENCH_32M as s
    assert (s.vocab_size, s.hidden_size, s.intermediate_size, s.num_hidden_layers, s.num_attention_heads,
            s.num_key_value_heads, s.tie_word_embeddings) == (512, 512, 2048, 8, 8, 4, True)


@pytest.mark.unit
def test_tether_runs_as_shipped_unless_pool_cpus_are_given():
    assert parse_pool_cpus(None) == {}  # no hand-tuned CPUs: the thread plan decides
    assert parse_pool_cpus("generator=8, learner=4") == {"generator": 8, "learner": 4}


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["generator", "gpu=2", "learner=0", "reward=x"])
def test_bad_pool_cpus_is_a_user_error(bad):
    with pytest.raises(BenchError) as e:
        parse_pool_cpus(bad)
    assert e.value.code == 2


@pytest.mark.integration
def test_peak_memory_sees_a_child_allocation():
    code = "import time; b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    with PeakMemory(proc.pid, interval=0.1) as mem:
        proc.wait()
    assert mem.by_role()["driver"]["peak_rss_bytes"] >= 300 << 20


@pytest.mark.integration
@pytest.mark.parametrize("argv", [["--rollouts", "6", "--minibatches", "4"], ["--sides", "torch,trl"],
                                  ["--epochs", "0"]])
def test_learner_bench_bad_flags_exit_2_in_one_line(argv):
    done = subprocess.run([sys.executable, "-m", "bench.learner", *argv], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("python -m bench.learner: error:")


@pytest.mark.unit
def test_work_floor_halves_only_the_learn_phase_for_the_shared_head():
    from bench.vs_trl import report, work_floor

    trl = {"generate_seconds": 10.0, "score_seconds": 15.0, "learn_seconds": 100.0}
    assert work_floor(trl) == {"separate": 1.0, "shared": pytest.approx(75.0 / 125.0)}
    side = {**trl, "step_seconds": 125.0, "sync_seconds": 0.0, "other_seconds": 0.0, "rollout_tokens_per_s": 1.0,
            "startup_seconds": 1.0, "peak_rss_bytes": {}, "tokens_per_step": 1, "expected_tokens_per_step": 1}
    text = report({"trl": side, "shared": {**side, "step_seconds": 100.0}})
    assert "tether critic=shared/TRL 0.80x (equal-speed work floor 0.60x)" in text


@pytest.mark.unit
def test_estimator_table_averages_seeds_and_leaves_out_an_absent_gold_score():
    from bench.estimators import table

    row = dict(eval_final=1.0, gold_final=float("nan"), kl_last=0.5, gain_per_1k_rollouts=1.0, gain_per_100s=2.0,
               step_s=0.5, learn_s=0.2)
    results = [{"variant": "grpo", "reward_last": r, **row} for r in (2.0, 3.0)] + \
              [{"variant": "gae-shared", "reward_last": 1.0, **row}]
    lines = table(results).splitlines()
    assert "gold_final" not in lines[0] and lines[0].startswith("| variant | reward_last | eval_final")
    assert lines[2].startswith("| gae-shared | 1 |") and lines[3].startswith("| grpo | 2.5 ± 0.5 |")


@pytest.mark.unit
def test_estimator_runs_are_summarised_from_their_folder_and_reused_only_when_finished(tmp_path):
    from bench.estimators import _finished, plot, summarise

    run = tmp_path / "grpo-s0"
    run.mkdir()
    rows = [{"step": 0, "eval/score_mean": -0.3, "eval/gold_score": 2.4}]
    rows += [{"step": s, "reward/mean": 0.1 * s, "perf/step_seconds": 0.5, "perf/learn_seconds": 0.3,
              "rollouts/used": 64, "kl/mean": 1.0} for s in (1, 2, 3)]
    rows[-1].update({"eval/score_mean": 0.2, "eval/gold_score": 2.9})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert not _finished(run, 3)  # no status: the run never ended
    (run / "status.json").write_text(json.dumps({"state": "succeeded", "steps": 3}))
    assert _finished(run, 3) and not _finished(run, 4)
    r = summarise("grpo", 0, run, wall_s=1.0)
    assert r["evals"] == [(0, -0.3, 2.4), (3, 0.2, 2.9)] and r["gold_final"] == 2.9
    assert r["rollouts"] == [64, 128, 192] and r["seconds"] == [0.5, 1.0, 1.5]
    plot([r], tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")

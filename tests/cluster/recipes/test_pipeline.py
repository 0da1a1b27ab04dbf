"""The whole recipe through its entrypoints (subprocesses, local Ray, vLLM and DeepSpeed on
CPU): python -m cluster.pipeline, then python -m cluster.sweep on its folder.

test_pipeline_short: tiny step counts; checks that each stage leaves what the next one reads
(the SFT checkpoint, gold-labelled pairs, the proxy with reward_stats.json, a PPO run wired
to both with the gold score logged) and that the sweep draws its plot and samples table.
test_pipeline_default (slow): the shipped config, with the over-optimisation it is built to show.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.demo.sentiment import gold
from cluster.recipes.pipeline import has_gold_key

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[3]
SHORT = ["sft.train.epochs=1", "pairs.prompts=16", "rm.data.eval_examples=4", "rm.train.epochs=1",
         "rl.run.steps=2", "rl.run.eval_every=1", "rl.run.samples_every=1", "rl.data.prompts_per_step=8",
         "rl.ppo.minibatch_size=32", "rl.ppo.ppo_epochs=1", "rl.run.plot_every=0"]


def cli(module: str, *args, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": "", "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout, env=env)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def status(run_dir: Path) -> str:
    return json.loads((run_dir / "status.json").read_text())["state"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("runs")
    p = cli("cluster.pipeline", "--config", "configs/pipeline-cpu.yaml", f"run.dir={runs}", "run.name=short", *SHORT)
    assert p.returncode == 0, p.stderr[-3000:]
    return runs / "short"


# The slow tier: four stage start-ups. The default tier: tests/cluster/recipes/test_stages.py::test_sft_one_rank
# runs a stage, tests/cluster/recipes/test_lora_stages.py::test_sft_trains_an_adapter_and_ppo_starts_from_it
# starts PPO from one.
@pytest.mark.slow
def test_pipeline_short_stages_feed_each_other(short_run):
    assert status(short_run) == "succeeded"
    sft_final = short_run / "sft" / "checkpoints" / "final"
    assert (sft_final / "config.json").is_file() and status(short_run / "sft") == "succeeded"
    sft_eval = [r["sft/eval_loss"] for r in read_jsonl(short_run / "sft" / "metrics.jsonl") if "sft/eval_loss" in r]
    assert len(sft_eval) == 2 and sft_eval[-1] < sft_eval[0] - 0.1  # one epoch learns (1.35 -> 1.11 measured)
    pairs = read_jsonl(short_run / "pairs.jsonl")
    assert pairs, "no labelled pairs"
    for row in pairs:  # hard labels: the chosen response is the one the gold function prefers
        g_chosen, g_rejected = gold([row["prompt"]] * 2, [row["chosen"], row["rejected"]])
        assert g_chosen == pytest.approx(row["gold_chosen"]) and g_chosen > g_rejected
    rm_final = short_run / "rm" / "checkpoints" / "final"
    assert (rm_final / "reward_stats.json").is_file()
    rm_rows = read_jsonl(short_run / "rm" / "metrics.jsonl")
    rm_eval = [r["rm/eval_loss"] for r in rm_rows if "rm/eval_loss" in r]
    assert len(rm_eval) == 2 and rm_eval[-1] < rm_eval[0] - 0.05  # the proxy learns the pairs (0.75 -> 0.58)
    rm_cfg = yaml.safe_load((short_run / "rm" / "config.yaml").read_text())
    assert rm_cfg["data"]["path"] == str(short_run / "pairs.jsonl")
    ppo = short_run / "ppo"
    assert status(ppo) == "succeeded"
    ppo_cfg = yaml.safe_load((ppo / "config.yaml").read_text())
    assert ppo_cfg["model"]["policy"] == str(sft_final)
    assert ppo_cfg["reward"]["model"] == str(rm_final) and ppo_cfg["reward"]["function"] is None
    assert ppo_cfg["reward"]["normalize"] is True
    rows = read_jsonl(ppo / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    assert rows[0]["perf/startup_imports_seconds"] == 0  # the SFT stage, run first, did the imports
    if has_gold_key():
        assert ppo_cfg["reward"]["gold"] == "cluster.demo.sentiment:gold"
        assert sum(isinstance(r.get("eval/gold_score"), float) for r in rows) >= 2


# The slow tier: a PPO start-up and two sweep runs. The default tier: test_sweep_without_pipeline_folder_is_one_line.
@pytest.mark.slow
@pytest.mark.timeout(3000)  # the pipeline fixture's run (if first) and two sweep runs, each allowed 900 s
def test_sweep_reuses_the_pipeline_folder(short_run):
    # one beta (a PPO start-up is most of a minute here); the second call reuses it and adds none
    p = cli("cluster.sweep", "--config", "configs/pipeline-cpu.yaml", "--betas", "0.5",
            f"run.dir={short_run.parent}", "run.name=short", *SHORT)
    assert p.returncode == 0, p.stderr[-3000:]
    out = short_run / "sweep"
    assert status(out / "beta-0.5") == "succeeded"
    cfg = yaml.safe_load((out / "beta-0.5" / "config.yaml").read_text())
    assert cfg["ppo"]["kl"]["beta"] == 0.5 and cfg["ppo"]["kl"]["target"] is None
    assert cfg["reward"]["model"] == str(short_run / "rm" / "checkpoints" / "final")
    assert (out / "sweep.png").stat().st_size > 10_000
    assert "| 0.5 | 2 |" in (out / "samples.md").read_text()
    again = cli("cluster.sweep", "--config", "configs/pipeline-cpu.yaml", "--betas", "0.5",
                f"run.dir={short_run.parent}", "run.name=short", *SHORT)
    assert again.returncode == 0 and "reusing" in again.stderr
    assert "| 0.5 |" in again.stdout  # the last-step table


def test_sweep_without_pipeline_folder_is_one_line(tmp_path):
    p = cli("cluster.sweep", "--config", "configs/pipeline-cpu.yaml", f"run.dir={tmp_path}", "run.name=none",
            timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("tether: error: ") and "cluster.pipeline" in p.stderr


def test_pipeline_bad_pairs_config_is_one_line():
    p = cli("cluster.pipeline", "pairs.samples_per_prompt=1", timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("tether: error: config: pairs.")


@pytest.mark.slow
def test_pipeline_default_over_optimises(tmp_path):
    """The shipped config in 15 minutes: the proxy learns from its pairs, and PPO raises the proxy reward."""
    p = cli("cluster.pipeline", "--config", "configs/pipeline-cpu.yaml", f"run.dir={tmp_path}", "run.name=full",
            timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    st = json.loads((tmp_path / "full" / "status.json").read_text())
    assert sum(st["seconds"].values()) < 900
    rows = read_jsonl(tmp_path / "full" / "ppo" / "metrics.jsonl")
    reward = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5


def test_pipeline_stage_config_mistake_names_the_stage(tmp_path):
    p = cli("cluster.pipeline", f"run.dir={tmp_path}", "sft.train.batch_size=12", timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("tether: error: config: [sft] train.batch_size=12")
    p = cli("cluster.pipeline", f"run.dir={tmp_path}", "pairs.gold=nope:nothing", timeout=120)
    assert p.returncode == 2 and "pairs.gold" in p.stderr and not list(tmp_path.iterdir())

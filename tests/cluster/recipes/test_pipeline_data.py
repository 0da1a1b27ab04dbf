"""The demo's hidden gold function and the pair labelling, against hand-computed values."""
from __future__ import annotations

import random

import pytest

from cluster.demo.sentiment import gold, label_pairs, repeated_fraction
from cluster.job.errors import UserError
from cluster.recipes.sweep import samples_table, series, split_betas

pytestmark = pytest.mark.unit


def test_repeated_fraction():
    assert repeated_fraction(" happy in the park.") == 0.0
    assert repeated_fraction(" happy happy happy happy") == pytest.approx(0.75)
    assert repeated_fraction(" Happy, happy day.") == pytest.approx(1 / 3)  # case-insensitive
    assert repeated_fraction("") == 0.0


def test_gold_hand_values():
    prompts = ["The cat was"] * 5
    responses = [" happy in the park.",          # sentiment 1/4*4 = 1, no repeats
                 " happy happy happy happy",     # sentiment 4, repeated 3/4: 4 - 8*0.75 = -2
                 " sad.",                        # sentiment -4
                 " glad and happy and warm",     # sentiment 3/5*4 = 2.4, "and" repeats: 2.4 - 8/5 = 0.8
                 " on the hill."]                # neutral: 0
    assert gold(prompts, responses) == pytest.approx([1.0, -2.0, -4.0, 0.8, 0.0])


def test_gold_checks_lengths():
    with pytest.raises(ValueError):
        gold(["a"], [" good", " bad"])


def test_label_pairs_hard_prefers_higher_gold_and_skips_ties():
    responses = [" good.", " bad.", " great.", " good."]
    scores = [4.0, -4.0, 4.0, 4.0]
    rows, skipped = label_pairs("P", responses, scores, max_pairs=10, labels="hard", rng=random.Random(0))
    # 6 unordered pairs: (0,2), (0,3), (2,3) tie (and (0,3) is also a duplicate) -> 3 skipped
    assert skipped == 3
    assert len(rows) == 3
    assert all(r["gold_chosen"] > r["gold_rejected"] for r in rows)
    assert sorted((r["chosen"], r["rejected"]) for r in rows) == [(" good.", " bad."), (" good.", " bad."),
                                                                   (" great.", " bad.")]
    assert all(r["prompt"] == "P" for r in rows)


def test_label_pairs_caps_pairs_per_prompt():
    rows, _ = label_pairs("P", [" a", " b", " c", " d"], [1.0, 2.0, 3.0, 4.0], max_pairs=2, labels="hard",
                          rng=random.Random(1))
    assert len(rows) == 2


def test_label_pairs_bradley_terry_follows_the_gold_gap():
    rng = random.Random(0)
    wins, n = 0, 2000
    for _ in range(n):
        rows, _ = label_pairs("P", [" x", " y"], [1.0, 0.0], max_pairs=1, labels="bradley_terry", rng=rng)
        wins += rows[0]["chosen"] == " x"
    assert wins / n == pytest.approx(1 / (1 + 2.718281828 ** -1), abs=0.03)  # sigmoid(1) = 0.731


def test_label_pairs_rejects_bad_input():
    with pytest.raises(ValueError, match="labels"):
        label_pairs("P", [" a", " b"], [0.0, 1.0], max_pairs=1, labels="soft", rng=random.Random(0))
    with pytest.raises(ValueError, match="scores"):
        label_pairs("P", [" a", " b"], [0.0], max_pairs=1, labels="hard", rng=random.Random(0))


def test_split_betas():
    assert split_betas(["--config", "c.yaml", "--betas", "0", "0.05", "0.5", "rl.run.steps=4"]) == \
        ([0.0, 0.05, 0.5], ["--config", "c.yaml", "rl.run.steps=4"])
    assert split_betas(["x=1"])[1] == ["x=1"]
    with pytest.raises(UserError):
        split_betas(["--betas", "rl.run.steps=4"])
    with pytest.raises(UserError):
        split_betas(["--betas", "-1"])


def test_series_and_samples_table():
    rows = [{"step": 0, "eval/gold_score": 0.5}, {"step": 1, "reward/mean": 1.0, "eval/gold_score": None},
            {"step": 2, "reward/mean": 2.0, "eval/gold_score": 0.1}]
    assert series(rows, "eval/gold_score") == ([0, 2], [0.5, 0.1])
    table = samples_table({0.0: [{"step": 5, "prompt": "A", "response": " x|y", "score": 1.0},
                                 {"step": 10, "prompt": "B", "response": " happy happy", "score": 2.5}]})
    assert "| 0 | 10 | B | happy happy | 2.50 |" in table
    assert "x\\|y" not in table  # only the last step's samples


def test_running_mean():
    from cluster.recipes.sweep import running_mean
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_the_pipeline_gives_every_stage_its_trackers_one_group_and_one_store(tmp_path, monkeypatch):
    from cluster.config.loader import load
    from cluster.config.pipeline import PipelineConfig
    from cluster.recipes.pipeline import with_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load(PipelineConfig, None, ["run.trackers=[wandb,mlflow]", "run.tracking.tags=[demo]",
                                      "sft.run.trackers=[tensorboard]"])
    root = tmp_path / "pipe"
    for stage in (cfg.sft, cfg.rm, cfg.rl):
        run = with_trackers(stage, cfg, root).run
        assert run.tracker_names() == ("wandb", "mlflow")  # the pipeline's, replacing a stage's own
        assert run.tracking.group == "pipe" and run.tracking.tags == ("demo",)
        assert run.tracking.mlflow_uri == f"sqlite:///{root.resolve()}/mlflow/mlflow.db"
    named = load(PipelineConfig, None, ["run.tracking.group=mine", "run.tracking.mlflow_uri=http://mlflow:5000"])
    assert with_trackers(named.rl, named, root).run.tracking.group == "mine"
    assert with_trackers(named.rl, named, root).run.tracking.mlflow_uri == "http://mlflow:5000"

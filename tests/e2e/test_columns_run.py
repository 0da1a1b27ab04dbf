"""Prompt-row columns through a real run: the reward (and the gold scorer, on the eval prompts)
gets each prompt's own `answer` and `source` as keyword arguments, in the reward replicas, from
a table put in the object store once; rows without an answer are skipped and counted; samples
and per-source metrics show them; and a resumed run draws the same prompts."""
import json
import logging
import os
from pathlib import Path

import pytest
import ray

from cluster import train
from cluster.demo.sentiment import builtin_prompts

pytestmark = pytest.mark.e2e
COMMON = ["reward.function=column_reward:graded", "reward.gold=column_reward:graded", "data.prompts_per_step=4",
          "data.eval_prompts=4", "ppo.minibatch_size=16", "run.checkpoint_every=2", "run.eval_every=3",
          "run.samples_every=1", "run.plot_every=0"]


@pytest.fixture
def logged_cluster(cluster_with_test_rewards):
    """The shared Ray, whose reward replicas import tests/e2e/column_reward.py; the log it
    appends to (one per test: removed after it)."""
    log = cluster_with_test_rewards / "columns.jsonl"
    yield log
    log.unlink(missing_ok=True)


def _data(path: Path) -> dict:
    """Built-in prompts with an int answer (their position) and a source by parity; every tenth
    row has no answer. Returns prompt -> (answer, source) of the rows a run keeps."""
    rows = [{"prompt": p, "source": "even" if i % 2 == 0 else "odd", **({} if i % 10 == 9 else {"answer": i})}
            for i, p in enumerate(builtin_prompts()[:60])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {r["prompt"]: (r["answer"], r["source"]) for r in rows if "answer" in r}


def _run(tmp_path, name, *overrides):
    assert train.main([f"run.dir={tmp_path}", f"run.name={name}", *COMMON, *overrides]) == 0
    run_dir = tmp_path / name
    return run_dir, [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def driver_counts(monkeypatch):
    """Rollouts unpickled in this (the driver's) process, and ray.put calls of the column table."""
    from core.columns import PromptColumns
    from core.rollout import Rollout

    count = {"rollouts": 0, "column_puts": 0}

    def counting_setstate(self, state):
        count["rollouts"] += 1
        self.__dict__.update(state)

    real_put = ray.put

    def counting_put(value, *args, **kwargs):
        count["column_puts"] += isinstance(value, PromptColumns)
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(Rollout, "__setstate__", counting_setstate, raising=False)
    monkeypatch.setattr(ray, "put", counting_put)
    return count


def test_columns_reach_the_reward_per_prompt(
        logged_cluster, tmp_path, driver_counts, caplog):
    truth = _data(tmp_path / "rows.jsonl")
    data = f"data.path={tmp_path / 'rows.jsonl'}"
    with caplog.at_level(logging.WARNING, logger="tether"):
        run_dir, full = _run(tmp_path, "full", data, "run.steps=3")
    assert "'missing_column': 6" in caplog.text  # the six rows without an answer: skipped, counted
    assert driver_counts == {"rollouts": 0, "column_puts": 1}  # by reference only; the table put once

    received = [json.loads(ln) for ln in logged_cluster.read_text().splitlines()]
    assert {r["pid"] for r in received} - {os.getpid()}  # the replicas scored with columns (not only the probe)
    for r in received:  # every pair came with its own prompt's answer (an int still) and source
        assert (r["answer"], r["source"]) == truth[r["prompt"]], r
        assert isinstance(r["answer"], int)
    # The eval prompts carried theirs too: each was scored (reward and gold) at steps 0 and 3.
    from cluster.data.prompts import PromptDataset
    from cluster.demo.tiny_models import build_tokenizer
    ds = PromptDataset.load(path=str(tmp_path / "rows.jsonl"), tokenizer_path=str(build_tokenizer()),
                            required_columns={"answer", "source"})
    _, held = ds.split_eval(4)
    assert set(held.texts) <= {r["prompt"] for r in received if r["pid"] != os.getpid()}

    steps = [m for m in full if m["step"] > 0]
    for m in steps:  # per-source reward of every step, over all its rollouts
        assert m["reward/even/count"] + m["reward/odd/count"] == m["rollouts/used"]
        assert min(m["reward/even/count"], m["reward/odd/count"]) > 0
        mean = (m["reward/even/mean"] * m["reward/even/count"] + m["reward/odd/mean"] * m["reward/odd/count"]) \
            / m["rollouts/used"]
        assert mean == pytest.approx(m["reward/mean"], rel=1e-6)
    samples = [json.loads(ln) for ln in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all((s["columns"]["answer"], s["columns"]["source"]) == truth[s["prompt"]] for s in samples)



@pytest.mark.slow  # two more runs; tests/e2e/test_resume.py holds resume to the same steps in the default suite
def test_a_resumed_run_draws_the_same_prompts_with_their_columns(logged_cluster, tmp_path):
    """Resume: 3 steps, and 2 steps then on to 3 from the step-2 checkpoint, draw the same prompts
    (each source's count per step says which were drawn, with the columns the reward used).
    Scores and losses are left to tests/e2e/test_resume.py: two fresh bf16 runs in one Ray
    already differ in them (kl/mean by ~3e-3 at step 1), before any resume."""
    _data(tmp_path / "rows.jsonl")
    data = f"data.path={tmp_path / 'rows.jsonl'}"
    _, full = _run(tmp_path, "full", data, "run.steps=3")
    part_dir, _ = _run(tmp_path, "part", data, "run.steps=2")
    _, resumed = _run(tmp_path, "part", data, "run.steps=3", f"run.resume={part_dir}")
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    for key in ("data/batches_issued", "reward/even/count", "reward/odd/count"):
        assert [m[key] for m in resumed if m["step"] > 0] == [m[key] for m in full if m["step"] > 0], key

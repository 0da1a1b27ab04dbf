"""Reward-model stage: python -m cluster.reward_model [--config configs/rm-tiny.yaml] [section.key=value ...]

Fits a sequence classifier (num_labels=1) on the body of ``model.base`` (the SFT
checkpoint, or the SFT run folder) to (prompt, chosen, rejected) rows with the
Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), on the learner group
(DeepSpeed ZeRO, 1..N ranks), with the held-out pair accuracy after every epoch. Writes
``checkpoints/final``: an HF checkpoint AutoModelForSequenceClassification loads and
cluster.train's ``reward.model`` takes, with ``reward_stats.json`` (the mean and std of
its scores over the training responses, for ``reward.normalize``) beside it.
"""
from __future__ import annotations

import json
import logging
import time

import numpy as np

from actors.rewards.reward_model import REWARD_STATS_FILE
from cluster.config.stages import RMConfig
from cluster.data.rows import epoch_shards, rank_shards
from cluster.recipes.stage import log_epoch, prepare_rows, run_stage, save_final
from cluster.runtime.state.lineage import STAGE_FILE, read_stage
from learner.objectives.preference import PreferenceObjective

log = logging.getLogger("tether")

OBJECTIVE = PreferenceObjective  # what the learner ranks train in this stage


def prepare(cfg: RMConfig) -> dict:
    d = cfg.data
    fields = {"data.prompt_field": d.prompt_field, "data.chosen_field": d.chosen_field,
              "data.rejected_field": d.rejected_field}
    prepared = prepare_rows(cfg, fields=fields, builtin="rm", noun="pairs")
    if (read_stage(prepared["base"]) or {}).get("stage") != "sft":
        log.warning("warning: model.base=%s is not an SFT output (no %s with stage 'sft'); the reward model "
                    "usually starts from the SFT model", cfg.model.base, STAGE_FILE)
    return prepared


def train(group, p: dict, metrics, run_dir) -> dict:
    cfg = p["cfg"]
    W, t = cfg.learner.replicas, cfg.train
    eval_shards = rank_shards(p["eval"], W)
    ev = first = group.evaluate(eval_shards, margin=t.margin)
    metrics.log(0, {"rm/eval_loss": ev["loss"], "rm/eval_accuracy": ev["accuracy"], "rm/epoch": 0})
    step = 0
    for epoch in range(1, t.epochs + 1):
        t0 = time.perf_counter()
        idx = epoch_shards(len(p["train"]), t.batch_size, W, cfg.data.seed, epoch)
        out = group.train([[p["train"][i] for i in rank] for rank in idx], margin=t.margin)
        for row in zip(out["loss"], out["accuracy"], out["gap"], out["grad_norm"], out["lr"]):
            step += 1
            metrics.log(step, {**dict(zip(("rm/loss", "rm/accuracy", "rm/score_gap", "rm/grad_norm", "rm/lr"), row)),
                               "rm/epoch": epoch})
        ev = group.evaluate(eval_shards, margin=t.margin)
        seconds = time.perf_counter() - t0
        metrics.log(step, {"rm/eval_loss": ev["loss"], "rm/eval_accuracy": ev["accuracy"], "rm/epoch": epoch,
                           "rm/epoch_loss": float(np.mean(out["loss"])), "rm/epoch_seconds": seconds})
        log_epoch("rm", epoch, t.epochs, seconds, loss=float(np.mean(out["loss"])), eval_loss=ev["loss"],
                  eval_accuracy=ev["accuracy"])
    final = save_final(group, run_dir, p["tokenizer"], stage="reward_model", base=p["base"], base_name=cfg.model.base)
    stats = score_stats(group, p["train"], W)
    (final / REWARD_STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    metrics.log(step, {"rm/score_mean": stats["mean"], "rm/score_std": stats["std"]})
    return {"checkpoint": str(final), "steps": step, "first_eval_accuracy": first["accuracy"],
            "eval_accuracy": ev["accuracy"], "eval_loss": ev["loss"], "score_mean": stats["mean"],
            "score_std": stats["std"]}


def score_stats(group, pairs: list, world_size: int) -> dict:
    """Mean and std of the trained model's scores over every training response, chosen and
    rejected alike: the spread the policy's responses are expected to fall in."""
    responses = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    per_rank = group.apply(PreferenceObjective.scores, rank_shards(responses, world_size))
    scores = np.concatenate(per_rank).astype(np.float64)
    return {"mean": float(scores.mean()), "std": float(scores.std()), "count": int(scores.size),
            "over": "chosen and rejected responses of the training pairs"}


def run(cfg: RMConfig) -> str:
    final = run_stage(cfg, stage="rm", objective=OBJECTIVE, prepare=prepare, train=train)
    return (f"rm/eval_accuracy {final['first_eval_accuracy']:.3f} -> {final['eval_accuracy']:.3f}; "
            f"checkpoint {final['checkpoint']}")

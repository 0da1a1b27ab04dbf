"""SFT stage: python -m cluster.sft [--config configs/sft-tiny.yaml] [section.key=value ...]

Fine-tunes a causal LM on (prompt, response) rows with the next-token loss on the
response tokens only, on the learner group (DeepSpeed ZeRO, 1..N ranks as Ray actors),
reports the held-out loss after every epoch, and writes ``checkpoints/final``: an HF
checkpoint with its tokenizer that cluster.train's ``model.policy`` takes as it is, and
``tether_stage.json`` (cluster/runtime/state/lineage.py) saying it is an SFT output and of what.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from cluster.config.stages import SFTConfig
from cluster.data.rows import epoch_shards, rank_shards
from cluster.recipes.stage import log_epoch, prepare_rows, run_stage, save_final
from learner.objectives.sft import SFTObjective

log = logging.getLogger("tether")

OBJECTIVE = SFTObjective  # what the learner ranks train in this stage


def prepare(cfg: SFTConfig) -> dict:
    d = cfg.data
    return prepare_rows(cfg, fields={"data.prompt_field": d.prompt_field, "data.response_field": d.response_field},
                        builtin="sft", noun="rows")


def train(group, p: dict, metrics, run_dir) -> dict:
    cfg = p["cfg"]
    W, t = cfg.learner.replicas, cfg.train
    eval_shards = rank_shards(p["eval"], W)
    first_eval = group.evaluate(eval_shards)["loss"]
    metrics.log(0, {"sft/eval_loss": first_eval, "sft/epoch": 0})
    step, losses, eval_loss = 0, [], first_eval
    for epoch in range(1, t.epochs + 1):
        t0 = time.perf_counter()
        idx = epoch_shards(len(p["train"]), t.batch_size, W, cfg.data.seed, epoch)
        out = group.train([[p["train"][i] for i in rank] for rank in idx])
        for loss, norm, lr in zip(out["loss"], out["grad_norm"], out["lr"]):
            step += 1
            metrics.log(step, {"sft/loss": loss, "sft/grad_norm": norm, "sft/lr": lr, "sft/epoch": epoch})
        losses += out["loss"]
        eval_loss = group.evaluate(eval_shards)["loss"]
        seconds = time.perf_counter() - t0
        metrics.log(step, {"sft/eval_loss": eval_loss, "sft/epoch": epoch,
                           "sft/epoch_loss": float(np.mean(out["loss"])),
                           "sft/tokens": out["tokens"], "sft/epoch_seconds": seconds})
        log_epoch("sft", epoch, t.epochs, seconds, loss=float(np.mean(out["loss"])), eval_loss=eval_loss)
    final = save_final(group, run_dir, p["tokenizer"], stage="sft", base=p["base"], base_name=cfg.model.base)
    return {"checkpoint": str(final), "steps": step, "first_loss": losses[0], "last_loss": losses[-1],
            "first_eval_loss": first_eval, "eval_loss": eval_loss}


def run(cfg: SFTConfig) -> str:
    final = run_stage(cfg, stage="sft", objective=OBJECTIVE, prepare=prepare, train=train)
    return (f"sft/eval_loss {final['first_eval_loss']:.3f} -> {final['eval_loss']:.3f}; "
            f"checkpoint {final['checkpoint']}")

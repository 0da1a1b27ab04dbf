"""The whole recipe in miniature: python -m cluster.pipeline [--config configs/pipeline-cpu.yaml] [key=value ...]

Four stages in one run folder, each the project's own entrypoint code:
  sft/          SFT of rl's starting model (cluster/recipes/sft.py), section ``sft``
  pairs.jsonl   K samples per training prompt from the SFT model (a vLLM Generator actor),
                paired and labelled by a hidden gold function (cluster/demo/sentiment.py), section ``pairs``
  rm/           the proxy reward model fitted to those pairs (cluster/recipes/reward_model.py), section ``rm``
  ppo/          PPO from the SFT model against the proxy (cluster/train.py), section ``rl``, with
                the gold function scored on the held-out eval prompts only (``reward.gold``)
The pipeline fills in what links them (rm's model.base and data.path; rl's model.policy,
reward.model/normalize/function and reward.gold); the stages' run.dir/run.name are its own.
Pairs come from rl's training prompts only, so the gold score is tracked on prompts neither
the proxy nor the policy trained on. cluster/recipes/sweep.py reruns the PPO stage at several betas.
"""
from __future__ import annotations

import json
import logging
import random
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from cluster.config.pipeline import PipelineConfig, has_gold_key, linked_rl
from cluster.job.errors import UserError
from cluster.job.folder import make_run_dir, running, write_status
from cluster.job.startup import check_fits, connect_ray
from cluster.recipes.stage import run_stage
from cluster.runtime.observe.trackers import check_trackers, tracking_uri

log = logging.getLogger("tether")
PAIRS_FILE = "pairs.jsonl"


def stage_dirs(root: Path) -> dict:
    return {"sft": root / "sft", "pairs": root / PAIRS_FILE, "rm": root / "rm", "ppo": root / "ppo"}


def sample_pairs(cfg: PipelineConfig, sft_model: str, out: Path) -> dict:
    """K samples per training prompt from the SFT model on a vLLM Generator actor, labelled
    by the gold function into ``out`` (jsonl); returns counts for the pipeline's summary."""
    import ray
    from transformers import AutoTokenizer

    from actors.generator import actor_class as generator_actor, engine_process_env
    from actors.rewards.scoring import load_function
    from cluster.data.prompts import PromptDataset
    from cluster.demo.sentiment import label_pairs
    from cluster.runtime.pools.pool import actor_env

    p, rl = cfg.pairs, cfg.rl
    gold = load_function(p.gold)
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    d = rl.data
    dataset = PromptDataset.load(path=d.path, field=d.field, tokenizer_path=sft_model, chat_template=d.chat_template,
                                 max_prompt_tokens=d.max_prompt_tokens, seed=d.seed, split=d.split,
                                 config_name=d.config_name, system_prompt=d.system_prompt)
    train_set, _ = dataset.split_eval(d.eval_prompts)  # the held-out eval prompts never become pairs
    n = min(p.prompts, len(train_set))
    sampling = replace(rl.generator.sampling, n=p.samples_per_prompt, seed=p.seed)
    generator = generator_actor().options(num_cpus=rl.generator.num_cpus, num_gpus=rl.generator.num_gpus,
                                              runtime_env={"env_vars": {**actor_env(rl), **engine_process_env(
                                                  num_gpus=rl.generator.num_gpus, tensor_parallel=1)}}).remote(
        model=sft_model, name="pairs-generator", sampling=sampling, engine=rl.generator.engine)
    try:
        result = ray.get(generator.generate.remote(train_set.prompt_ids[:n], list(range(n))))
    finally:
        ray.kill(generator)
    responses = [[] for _ in range(n)]
    for r in result.rollouts:
        responses[r.prompt_index].append(tokenizer.decode(r.response_ids, skip_special_tokens=True))
    rng, rows, skipped = random.Random(p.seed), [], 0
    for i, texts in enumerate(responses):
        if not texts:
            continue
        scores = [float(s) for s in gold([train_set.texts[i]] * len(texts), texts)]
        got, ties = label_pairs(train_set.texts[i], texts, scores, max_pairs=p.pairs_per_prompt, labels=p.labels,
                                rng=rng)
        rows += got
        skipped += ties
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    agree = sum(r["gold_chosen"] > r["gold_rejected"] for r in rows)
    log.info("pairs: %d labelled pairs from %d prompts x %d samples (%d candidate pairs were ties or duplicates); "
             "%s", len(rows), n, p.samples_per_prompt, skipped, out)
    return {"pairs": len(rows), "prompts": n, "ties_skipped": skipped, "gold_agreement": agree / max(1, len(rows))}


def run(cfg: PipelineConfig) -> str:
    """The four stages in one run folder; the summary line of the whole."""
    check_inputs(cfg)
    root = make_run_dir(cfg)
    (root / "checkpoints").rmdir()  # make_run_dir's; the stages keep their checkpoints in their own folders
    seconds, summary = {}, {}
    with running(root, failed={"seconds": seconds}, stage="sft"):
        connect_ray(cfg.rl)  # a local cluster sized for the largest stage, PPO
        run_stages(cfg, root, seconds, summary)
    write_status(root, "succeeded", seconds=seconds, summary=summary)
    shown = " ".join(f"{k} {v:.0f}s" for k, v in seconds.items())
    return (f"{summary['pairs']['pairs']} gold-labelled pairs, proxy held-out accuracy "
            f"{summary['rm']['eval_accuracy']:.2f}; wall time {shown}; folder {root}")


def with_trackers(stage_cfg, cfg: PipelineConfig, root: Path):
    """A stage's config with the pipeline's trackers: one group (the pipeline folder's name unless
    run.tracking.group says) and, unless set, one local MLflow store, the pipeline folder's."""
    t = cfg.run.tracking
    tracking = replace(t, group=t.group or root.name, mlflow_uri=tracking_uri(t.mlflow_uri, root))
    return replace(stage_cfg, run=replace(stage_cfg.run, trackers=cfg.run.trackers, tracking=tracking))


def check_inputs(cfg: PipelineConfig) -> None:
    """What would fail only after SFT, refused before it starts."""
    from actors.rewards.scoring import load_function

    check_trackers(cfg.run, run_dir=Path(cfg.run.dir) / (cfg.run.name or "pipeline"), stage="pipeline")

    if not has_gold_key():
        log.warning("warning: this checkout's PPO config has no reward.gold; eval/gold_score will be missing")
    try:
        load_function(cfg.pairs.gold)
    except ValueError as e:
        raise UserError(f"pairs.gold: {e}") from None
    try:
        check_fits(cfg.rl, None)  # the local Ray is sized for the largest stage, PPO
    except ValueError as e:
        raise UserError(f"[rl] {e}") from None


def run_stages(cfg: PipelineConfig, root: Path, seconds: dict, summary: dict) -> None:
    """SFT, pairs, reward model, PPO; each stage's wall time into ``seconds`` once it is done."""
    from cluster.recipes import reward_model, sft
    from cluster.runtime import service

    dirs = stage_dirs(root)
    with timed(seconds, "sft"):
        sft_cfg = with_trackers(replace(cfg.sft, run=replace(cfg.sft.run, dir=str(root), name="sft")), cfg, root)
        sft_final = run_stage(sft_cfg, stage="sft", objective=sft.OBJECTIVE, prepare=sft.prepare, train=sft.train)
    write_status(root, "running", stage="pairs", seconds=seconds)
    with timed(seconds, "pairs"):
        summary["pairs"] = sample_pairs(cfg, sft_final["checkpoint"], dirs["pairs"])
        if summary["pairs"]["pairs"] < cfg.rm.train.batch_size + cfg.rm.data.eval_examples:
            raise UserError(f"pairs: only {summary['pairs']['pairs']} labelled pairs, fewer than rm.train.batch_size"
                            f" + rm.data.eval_examples; raise pairs.prompts or pairs.pairs_per_prompt")
    write_status(root, "running", stage="rm", seconds=seconds)
    with timed(seconds, "rm"):
        rm_cfg = replace(cfg.rm, model=replace(cfg.rm.model, base=str(dirs["sft"])),
                         data=replace(cfg.rm.data, path=str(dirs["pairs"])),
                         run=replace(cfg.rm.run, dir=str(root), name="rm"))
        rm_final = run_stage(with_trackers(rm_cfg, cfg, root), stage="rm", objective=reward_model.OBJECTIVE,
                             prepare=reward_model.prepare, train=reward_model.train)
    summary["rm"] = {k: rm_final[k] for k in ("first_eval_accuracy", "eval_accuracy")}
    write_status(root, "running", stage="ppo", seconds=seconds)
    with timed(seconds, "ppo"):
        rl = linked_rl(cfg.rl, policy=sft_final["checkpoint"], reward_model=rm_final["checkpoint"],
                       gold=cfg.pairs.gold, run_dir=str(root))
        ppo_final = service.run(with_trackers(rl, cfg, root))
    summary["ppo"] = {k: v for k, v in ppo_final.items() if isinstance(v, (int, float))}


@contextmanager
def timed(seconds: dict, stage: str) -> Iterator[None]:
    """``seconds[stage]``: the block's wall time, if it completes."""
    t0 = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - t0

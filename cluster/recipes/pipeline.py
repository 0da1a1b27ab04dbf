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

import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from cluster.config.ppo import ConfigError, TetherConfig, check_run_name, validate
from cluster.config.stages import RMConfig, SFTConfig
from cluster.job.errors import UserError
from cluster.job.folder import make_run_dir, write_status
from cluster.job.startup import check_fits, connect_ray
from cluster.recipes.stage import run_stage

log = logging.getLogger("tether")
PAIRS_FILE = "pairs.jsonl"


@dataclass(frozen=True)
class PairsConfig:
    gold: str = "cluster.demo.sentiment:gold"  # the hidden labeller: module:function(prompts, responses) -> floats
    prompts: int = 24                # training prompts (of rl's prompt set) sampled for pairs
    samples_per_prompt: int = 4      # K responses per prompt from the SFT model
    pairs_per_prompt: int = 2        # labelled pairs kept per prompt (ties and duplicates are skipped)
    labels: str = "hard"             # hard (higher gold score chosen) | bradley_terry (chosen w.p. sigmoid(gold gap))
    seed: int = 0                    # sampling and pair selection


@dataclass(frozen=True)
class PipelineRunConfig:
    dir: str = "runs"                # the pipeline folder is created under this directory
    name: Optional[str] = None       # pipeline folder name; default: timestamp


@dataclass(frozen=True)
class PipelineConfig:
    """SFT -> gold-labelled pairs -> proxy reward model -> PPO against the proxy, one run folder."""
    pairs: PairsConfig = field(default_factory=PairsConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    rl: TetherConfig = field(default_factory=TetherConfig)
    run: PipelineRunConfig = field(default_factory=PipelineRunConfig)

    to_dict, to_yaml = TetherConfig.to_dict, TetherConfig.to_yaml

    def validate(self) -> None:
        p = self.pairs
        if p.prompts < 1 or p.samples_per_prompt < 2 or p.pairs_per_prompt < 1:
            raise ConfigError("config: pairs.prompts and pairs.pairs_per_prompt must be >= 1 and "
                              "pairs.samples_per_prompt >= 2 (a pair needs two responses)")
        if p.labels not in ("hard", "bradley_terry"):
            raise ConfigError(f"config: pairs.labels={p.labels!r} must be hard or bradley_terry")
        check_run_name(self.run.name)
        checks = (("sft", self.sft.validate), ("rm", self.rm.validate),
                  ("rl", lambda: validate(linked_rl(self.rl, policy="sft", reward_model="rm", gold=p.gold))))
        for section, check in checks:
            try:
                check()
            except ConfigError as e:  # the stages' messages name their own keys: say which stage
                raise ConfigError(str(e).replace("config: ", f"config: [{section}] ", 1)) from None


def has_gold_key() -> bool:
    """Whether this checkout's PPO config has ``reward.gold`` (the eval-only gold scorer)."""
    from cluster.config.ppo import RewardPoolConfig
    return "gold" in {f.name for f in dataclasses.fields(RewardPoolConfig)}


def linked_rl(rl: TetherConfig, *, policy: str, reward_model: str, gold: str, run_dir: str | None = None,
              name: str = "ppo") -> TetherConfig:
    """rl with the pipeline's links: policy and reference = the SFT model, reward = the proxy."""
    reward = replace(rl.reward, model=reward_model, function=None, normalize=True,
                     **({"gold": gold} if has_gold_key() else {}))
    run = replace(rl.run, dir=run_dir or rl.run.dir, name=name)
    return replace(rl, model=replace(rl.model, policy=policy), reference=replace(rl.reference, model=None),
                   reward=reward, run=run)


def stage_dirs(root: Path) -> dict:
    return {"sft": root / "sft", "pairs": root / PAIRS_FILE, "rm": root / "rm", "ppo": root / "ppo"}


def sample_pairs(cfg: PipelineConfig, sft_model: str, out: Path) -> dict:
    """K samples per training prompt from the SFT model on a vLLM Generator actor, labelled
    by the gold function into ``out`` (jsonl); returns counts for the pipeline's summary."""
    import ray
    from transformers import AutoTokenizer

    from actors.generator import actor_class as generator_actor, engine_process_env
    from actors.reward import load_function
    from cluster.data.prompts import PromptDataset
    from cluster.demo.sentiment import label_pairs
    from cluster.runtime.pools import actor_env

    p, rl = cfg.pairs, cfg.rl
    gold = load_function(p.gold)
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    d = rl.data
    dataset = PromptDataset.load(path=d.path, field=d.field, tokenizer_path=sft_model, chat_template=d.chat_template,
                                 max_prompt_tokens=d.max_prompt_tokens, seed=d.seed)
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
    from cluster.recipes import reward_model, sft
    from cluster.runtime import service

    if not has_gold_key():
        log.warning("warning: this checkout's PPO config has no reward.gold; eval/gold_score will be missing")
    from actors.reward import load_function
    try:
        load_function(cfg.pairs.gold)  # a bad gold spec fails now, not after SFT
    except ValueError as e:
        raise UserError(f"pairs.gold: {e}") from None
    try:
        check_fits(cfg.rl, None)  # the local Ray is sized for the largest stage, PPO
    except ValueError as e:
        raise UserError(f"[rl] {e}") from None
    root = make_run_dir(cfg)
    (root / "checkpoints").rmdir()  # make_run_dir's; the stages keep their checkpoints in their own folders
    dirs, seconds, summary = stage_dirs(root), {}, {}
    write_status(root, "running", stage="sft")
    connect_ray(cfg.rl)  # a local cluster sized for the largest stage, PPO
    try:
        t0 = time.perf_counter()
        sft_final = run_stage(replace(cfg.sft, run=replace(cfg.sft.run, dir=str(root), name="sft")),
                                  kind="policy", prepare=sft.prepare, train=sft.train)
        seconds["sft"] = time.perf_counter() - t0
        write_status(root, "running", stage="pairs", seconds=seconds)
        t0 = time.perf_counter()
        summary["pairs"] = sample_pairs(cfg, sft_final["checkpoint"], dirs["pairs"])
        if summary["pairs"]["pairs"] < cfg.rm.train.batch_size + cfg.rm.data.eval_examples:
            raise UserError(f"pairs: only {summary['pairs']['pairs']} labelled pairs, fewer than rm.train.batch_size"
                            f" + rm.data.eval_examples; raise pairs.prompts or pairs.pairs_per_prompt")
        seconds["pairs"] = time.perf_counter() - t0
        write_status(root, "running", stage="rm", seconds=seconds)
        t0 = time.perf_counter()
        rm_cfg = replace(cfg.rm, model=replace(cfg.rm.model, base=str(dirs["sft"])),
                         data=replace(cfg.rm.data, path=str(dirs["pairs"])),
                         run=replace(cfg.rm.run, dir=str(root), name="rm"))
        rm_final = run_stage(rm_cfg, kind="reward", prepare=reward_model.prepare,
                                          train=reward_model.train)
        seconds["rm"] = time.perf_counter() - t0
        summary["rm"] = {k: rm_final[k] for k in ("first_eval_accuracy", "eval_accuracy")}
        write_status(root, "running", stage="ppo", seconds=seconds)
        t0 = time.perf_counter()
        ppo_final = service.run(linked_rl(cfg.rl, policy=sft_final["checkpoint"], reward_model=rm_final["checkpoint"],
                                        gold=cfg.pairs.gold, run_dir=str(root)))
        seconds["ppo"] = time.perf_counter() - t0
    except BaseException as e:
        from cluster.job.errors import one_line
        write_status(root, "failed", seconds=seconds, reason=one_line(e))
        raise
    summary["ppo"] = {k: v for k, v in ppo_final.items() if isinstance(v, (int, float))}
    write_status(root, "succeeded", seconds=seconds, summary=summary)
    shown = " ".join(f"{k} {v:.0f}s" for k, v in seconds.items())
    return (f"{summary['pairs']['pairs']} gold-labelled pairs, proxy held-out accuracy "
            f"{summary['rm']['eval_accuracy']:.2f}; wall time {shown}; folder {root}")

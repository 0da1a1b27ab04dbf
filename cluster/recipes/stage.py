"""What the SFT and reward-model entrypoints share: the command line, the run folder, the
learner group on Ray, the epoch loop's bookkeeping and the final checkpoint.

The conventions are every job's (cluster/job/): a run folder with config.yaml,
metrics.jsonl and status.json; exit 0 on success, 2 with one line ``tether: error: ...``
for a user mistake, 1 for a failed run (traceback in error.log); Ray joined as
cluster.train joins it (so ``ray job submit`` works).
"""
from __future__ import annotations

import json
import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from cluster.job.command import job_main
from cluster.job.errors import UserError
from cluster.job.folder import make_run_dir, running, write_status
from cluster.job.startup import connect_ray
from cluster.runtime.observe.metrics import json_line, numbers  # the PPO run's JSON rules (NaN, numpy scalars)
from cluster.runtime.observe.trackers import TrackerSet, check_trackers, open_trackers
from cluster.runtime.pools.threads import node_cores, thread_env
from cluster.runtime.state.models import resolve_model
from core.infra.errors import user_input

log = logging.getLogger("tether")


def stage_threads(lp) -> dict:
    """The learner ranks are all that computes in a stage: on CPU they share the node's cores."""
    return {} if lp.num_gpus else thread_env(max(int(lp.num_cpus), node_cores() // lp.replicas))


def stage_main(argv=None, *, name: str, config_cls, default_config: str, run: Callable,
               prog: str | None = None) -> int:
    """job_main for ``python -m cluster.<name>``: ``config_cls`` from --config (default
    configs/<default_config>) and the overrides, then ``run(cfg) -> summary line``."""
    def load_and_run(args) -> str:
        from cluster.config.ppo import CONFIGS
        from cluster.config.stages import load_stage_config
        from cluster.job.startup import claim_imports
        claim_imports(time.time())  # a PPO stage after this one (the pipeline's) imported nothing
        return run(load_stage_config(config_cls, args.config or CONFIGS / default_config, args.overrides))

    return job_main(argv, prog=prog or f"python -m cluster.{name}", description=config_cls.__doc__,
                    config_cls=lambda: config_cls, run=load_and_run)


def resolve_base(name: str) -> str:
    """model.base: builtin:* (built offline), a run folder of an earlier stage (its final
    checkpoint, if that run succeeded), or a model directory."""
    path = Path(name)
    if (path / "status.json").is_file():
        status = json.loads((path / "status.json").read_text()).get("state")
        final = path / "checkpoints" / "final"
        if status != "succeeded" or not (final / "config.json").is_file():
            raise UserError(f"model.base={name!r} is a run folder whose run did not succeed (status {status!r}); "
                            "point it at a succeeded run or a model directory")
        return str(final)
    resolved = resolve_model(name, "model.base")
    if not (Path(resolved) / "config.json").is_file():
        raise UserError(f"model.base={name!r} is not a Hugging Face model directory (no config.json)")
    return resolved


def prepare_model(cfg):
    """(base model path, tokenizer path, tokenizer), checked before anything starts."""
    from transformers import AutoTokenizer

    from cluster.runtime.prepare import check_vocabulary

    base = resolve_base(cfg.model.base)
    tokenizer_path = cfg.model.tokenizer or base
    with user_input():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    check_vocabulary(tokenizer, tokenizer_path, base, "model.base")
    return base, tokenizer_path, tokenizer


def prepare_rows(cfg, *, fields: dict, builtin: str, noun: str) -> dict:
    """The base model, tokenizer and tokenized rows (training, held out) of a stage;
    ``fields``: config key -> column, the prompt's first; ``noun``: what a row is, for messages."""
    from cluster.data.rows import load_rows

    base, tokenizer_path, tokenizer = prepare_model(cfg)
    d = cfg.data
    with user_input():
        data = load_rows(path=d.path, fields=fields, tokenizer=tokenizer, tokenizer_path=tokenizer_path,
                         chat_template=d.chat_template, append_eos=d.append_eos, max_seq_len=d.max_seq_len,
                         builtin=builtin, split=d.split, config_name=d.config_name)
    if data.skip_counts:
        log.warning("data: skipped %d rows %s, e.g. %s", sum(data.skip_counts.values()), data.skip_counts,
                    data.skipped[0])
    train_rows, eval_rows = data.split(d.eval_examples, d.seed)
    if len(train_rows) < cfg.train.batch_size:
        raise UserError(f"data: {len(train_rows)} training {noun} in {data.source} (after holding out "
                        f"data.eval_examples={d.eval_examples}) are fewer than "
                        f"train.batch_size={cfg.train.batch_size}")
    log.info("%s: %d training %s, %d held out, from %s; base %s", builtin, len(train_rows), noun, len(eval_rows),
             data.source, base)
    return {"base": base, "tokenizer": tokenizer, "train": train_rows, "eval": eval_rows, "cfg": cfg}


class StageMetrics:
    """metrics.jsonl of a stage: one JSON object per line, ``step`` = optimizer steps so far; the
    same rows to the stage's experiment trackers."""

    def __init__(self, run_dir: Path, trackers: TrackerSet) -> None:
        self._f = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.trackers = trackers

    def log(self, step: int, metrics: dict) -> None:
        self._f.write(json_line({"step": int(step), "time": time.time(), **metrics}) + "\n")
        self._f.flush()
        self.trackers.log(int(step), numbers(metrics))

    def close(self, checkpoint: str) -> None:
        self._f.close()
        self.trackers.finish("finished", checkpoint=checkpoint)


def run_stage(cfg, *, stage: str, objective: type, prepare: Callable, train: Callable) -> dict:
    """``prepare(cfg)`` (refusing user input with UserErrors), a run folder, a learner group
    training ``objective`` (learner/objectives/objective.py), then
    ``train(group, prepared, metrics, run_dir) -> final``;
    ``stage`` (sft, rm) names it to the experiment trackers."""
    from cluster.runtime.pools.pool import quiet_libraries

    if not cfg.run.library_logs:
        quiet_libraries()
    check_trackers(cfg.run, run_dir=Path(cfg.run.dir) / (cfg.run.name or stage), stage=stage)
    prepared = prepare(cfg)
    run_dir = make_run_dir(cfg)
    log.info("run folder: %s (resolved config in config.yaml)", run_dir)
    # ExitStack first: the status is written before the group and its reservation go
    with ExitStack() as cleanup, running(run_dir):
        trackers = cleanup.enter_context(open_trackers(cfg.run, run_dir=run_dir, stage=stage, config=cfg.to_dict()))
        ray_logs = connect_ray(cfg)
        if ray_logs and not cfg.run.library_logs:
            log.info("library logs: the learner ranks' in Ray's worker logs under %s (run.library_logs=true shows "
                     "them here)", ray_logs)
        metrics = StageMetrics(run_dir, trackers)
        group = learner_group(cfg, objective, prepared["base"], cleanup)
        final = train(group, prepared, metrics, run_dir)
        metrics.close(final["checkpoint"])
        write_status(run_dir, "succeeded", checkpoint=final["checkpoint"],
                     final={k: v for k, v in final.items() if isinstance(v, (int, float))})
        return final


def learner_group(cfg, objective: type, base: str, cleanup: ExitStack):
    """The stage's learner ranks in a placement group of their own; ``cleanup`` releases both."""
    from ray.util.placement_group import remove_placement_group

    from cluster.config.labels import parse_labels
    from cluster.runtime.pools.pool import PlacementError, actor_env, reserve
    from learner.group import LearnerGroup

    lp = cfg.learner
    try:
        pg = reserve("learner", lp.replicas, lp.num_cpus, lp.num_gpus, cfg.resources.placement_timeout_s,
                     labels=parse_labels(lp.node_labels), strategy=lp.strategy)
    except PlacementError as e:
        raise UserError(str(e)) from None
    cleanup.callback(remove_placement_group, pg)
    group = LearnerGroup(model=base, config=cfg.learner_config(), world_size=lp.replicas,
                         num_cpus_per_rank=lp.num_cpus, num_gpus_per_rank=lp.num_gpus, placement_group=pg,
                         env={**actor_env(cfg), **stage_threads(lp)}, objective=objective)
    cleanup.callback(group.shutdown)
    return group


def save_final(group, run_dir: Path, tokenizer, *, stage: str, base: str, base_name: str) -> Path:
    """The final HF checkpoint: the model, the run's tokenizer, and tether_stage.json."""
    from cluster.runtime.state.lineage import write_stage
    from learner.policy import VALUE_HEAD_FILE

    out = run_dir / "checkpoints" / "final"
    group.save_pretrained_policy(out)
    (out / VALUE_HEAD_FILE).unlink(missing_ok=True)  # SFT: PPO starts its value head afresh anyway
    tokenizer.save_pretrained(out)
    write_stage(out, stage, base, base_name=base_name)
    return out


def log_epoch(prefix: str, epoch: int, epochs: int, seconds: float, **values: float) -> None:
    shown = " | ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in values.items())
    log.info("%s epoch %d/%d | %s | %.1fs", prefix, epoch, epochs, shown, seconds)

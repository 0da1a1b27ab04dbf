"""Job entrypoint: python -m cluster.train [--config configs/X.yaml] [section.key=value ...]

Joins the Ray cluster it runs in (under `ray job submit`, or RAY_ADDRESS /
resources.address), else starts a local one. Exit 0 on success; on a user
mistake, one line on stderr and exit 2; on a failed run, one line and exit 1.
The run folder's status.json says which; only a "succeeded" folder is a result.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from cluster.startup import StartupClock, check_fits, connect_ray

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"
log = logging.getLogger("tether")


# What the job needs importable in the Python that runs it: import name -> pip name.
REQUIRED_MODULES = {"torch": "torch", "ray": "ray", "vllm": "vllm", "transformers": "transformers",
                    "deepspeed": "deepspeed", "yaml": "pyyaml"}


def missing_dependencies() -> list[str]:
    """The REQUIRED_MODULES this interpreter cannot import, as pip names; found without importing."""
    missing = []
    for module, package in REQUIRED_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken install counts as missing
            found = False
        if not found:
            missing.append(package)
    return missing


def dependency_error(missing: list[str]) -> str:
    return (f"tether: error: this Python ({sys.executable}) lacks {', '.join(missing)}; run the job "
            "with the project's environment on every node (start `ray` from .venv: see README "
            '"On a Ray cluster"), or give the job a container image or runtime_env that has them')


class UserError(Exception):
    """Bad config, data or cluster request: reported as one line, exit code 2."""


def parse_args(argv, prog: str = "python -m cluster.train", description: str = __doc__.split("\n")[0]):
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--config", default=None, help="YAML config (default: the embedded one)")
    ap.add_argument("--help-config", action="store_true", help="print every config key and exit")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppo.kl.beta=0.02")
    return ap.parse_args(argv)


def resolve_model(name: str, key: str = "model.policy") -> str:
    """builtin:* names build the offline tiny models (cached); anything else is a path."""
    from cluster.config import BUILTIN_POLICY, BUILTIN_POLICY_30M

    if name == BUILTIN_POLICY:
        from cluster.pretrain import build_pretrained_policy
        return str(build_pretrained_policy())
    if name == BUILTIN_POLICY_30M:  # randomly initialised: for throughput, not for learning
        from cluster.tiny_models import SPEC_30M, build_policy
        return str(build_policy(SPEC_30M))
    if name.startswith("builtin:"):
        raise UserError(f"{key}={name!r} is not a built-in model; use {BUILTIN_POLICY} "
                        f"or {BUILTIN_POLICY_30M} or a model directory")
    if not Path(name).exists():
        raise UserError(f"{key}={name!r} does not exist; point it at a Hugging Face model directory")
    return name


def make_run_dir(cfg) -> Path:
    name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.run.dir) / name
    if (run_dir / "status.json").exists():
        raise UserError(f"run folder {run_dir} already holds a run; choose another run.name")
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    except OSError as e:
        raise UserError(f"cannot create run folder {run_dir} ({e.strerror}); set run.dir to a "
                        "writable directory") from None
    return run_dir


def write_status(run_dir: Path, state: str, **extra) -> None:
    tmp = run_dir / ".status.json.tmp"
    tmp.write_text(json.dumps({"state": state, "time": time.time(), **extra}, default=float))
    tmp.replace(run_dir / "status.json")


# Example pairs for the reward probe: short, plain, what any reward should score.
PROBE_RESPONSES = (" It was a good day.", " No.")


def check_vocabulary(tokenizer, tokenizer_path: str, model_dir: str, key: str):
    """The model must have an embedding for every id the tokenizer makes; returns its config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size and len(tokenizer) > vocab_size:
        raise UserError(f"the tokenizer at {tokenizer_path} has {len(tokenizer)} tokens but {key}={model_dir!r} "
                        f"has vocab_size={vocab_size} (ids from {vocab_size} on have no embedding); set "
                        "model.tokenizer to the tokenizer the model was trained with")
    return config


def check_same_vocabulary(tokenizer, tokenizer_path: str, policy: str) -> None:
    """A model.tokenizer other than the policy's own must give every token of the policy's own
    tokenizer the same id (it may add tokens): otherwise ids mean other words, silently."""
    from transformers import AutoTokenizer

    own_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if Path(tokenizer_path).resolve() == Path(policy).resolve() or \
            not any((Path(policy) / f).exists() for f in own_files):
        return
    own, given = AutoTokenizer.from_pretrained(policy).get_vocab(), tokenizer.get_vocab()
    moved = [t for t, i in own.items() if given.get(t) != i]
    if moved:
        t = moved[0]
        raise UserError(f"model.tokenizer={tokenizer_path!r} does not match the policy's vocabulary: {len(moved)} "
                        f"of the {len(own)} tokens of {policy}'s own tokenizer are missing or have other ids (e.g. "
                        f"{t!r}: {own[t]} vs {given.get(t)}); leave model.tokenizer null or use the policy's tokenizer")


def check_reward_model(path: str, tokenizer, tokenizer_path: str) -> None:
    """The reward model scores the policy's token ids with one output: check both from its config."""
    from actors.reference import resolve_model_path

    try:
        path = resolve_model_path(path, "reward.model")
    except FileNotFoundError:
        raise UserError(f"reward.model={path!r} does not exist; point it at a sequence-classification model "
                        "directory, or set reward.model=null and name a reward.function") from None
    config = check_vocabulary(tokenizer, tokenizer_path, path, "reward.model")
    if getattr(config, "num_labels", 1) != 1:
        raise UserError(f"reward.model={path!r} has num_labels={config.num_labels}; a reward model outputs one "
                        "score (num_labels=1): use a reward checkpoint, or a reward.function")


def prepare(cfg):
    """Everything that can fail on user input, before any actor starts."""
    from transformers import AutoTokenizer

    from cluster.data import PromptDataset

    if cfg.run.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UserError("run.tensorboard is true but the tensorboard package is missing; "
                            "pip install tensorboard (or set run.tensorboard=false)") from None
    policy = resolve_model(cfg.model.policy)
    # Reward problems surface here, in the driver, not as a dead actor a minute later.
    from actors.reward import load_function, probe_function
    for key, spec in (("reward.function", cfg.reward.function), ("reward.gold", cfg.reward.gold)):
        if spec:
            load_function(spec, key)
    tokenizer_path = cfg.model.tokenizer or policy
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    check_same_vocabulary(tokenizer, tokenizer_path, policy)
    check_vocabulary(tokenizer, tokenizer_path, policy, "model.policy")
    if cfg.reward.model:
        check_reward_model(cfg.reward.model, tokenizer, tokenizer_path)
        if cfg.reward.normalize:  # the actors would fail on it one by one: refuse here, in one line
            from actors.reward import load_reward_stats
            load_reward_stats(cfg.reward.model)
    if cfg.reference.model:
        from cluster.lineage import check_reference
        check_reference(cfg.reference.model, tokenizer, tokenizer_path, policy)
    d = cfg.data
    dataset = PromptDataset.load(path=d.path, field=d.field, tokenizer_path=tokenizer_path,
                                 chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens,
                                 seed=d.seed)
    if dataset.num_skipped:
        log.warning("data: skipped %d rows %s, e.g. %s", dataset.num_skipped, dataset.skip_counts,
                    dataset.skipped[0])
    train_set, eval_set = dataset.split_eval(d.eval_prompts)
    if len(train_set) < d.prompts_per_step:  # else the first step fails, after the run folder exists
        raise UserError(f"data: {len(train_set)} training prompts in {dataset.source} (after holding out "
                        f"data.eval_prompts={d.eval_prompts}) are fewer than data.prompts_per_step="
                        f"{d.prompts_per_step}; lower prompts_per_step or eval_prompts, or add prompts")
    prompts = train_set.texts[:len(PROBE_RESPONSES)]
    for key, spec in (("reward.function", cfg.reward.function), ("reward.gold", cfg.reward.gold)):
        if spec:  # with real prompts: a function that cannot score them would void every batch (or eval)
            probe_function(spec, prompts, list(PROBE_RESPONSES[:len(prompts)]), key)
    return policy, tokenizer_path, tokenizer, train_set, eval_set


def prepare_ptx(cfg, tokenizer_path: str):
    """The packed PTX rows when ppo.ptx_coef > 0 (cluster/ptx.py), else None."""
    p = cfg.ptx
    if cfg.ppo.ptx_coef == 0:
        if p.path is not None:
            log.warning("ptx.path is set but ppo.ptx_coef=0: the PTX loss is off (set ppo.ptx_coef > 0 to use it)")
        return None
    from cluster.ptx import PTXData
    ptx = PTXData.load(path=p.path, field=p.field, tokenizer_path=tokenizer_path,
                       seq_len=p.tokens_per_row(cfg.generator.engine.max_model_len),
                       builtin_policy=cfg.model.policy.startswith("builtin:"), seed=cfg.run.seed)
    log.info("ptx: %d rows of %d tokens from %s, %d per optimizer step, coefficient %g", len(ptx),
             ptx.rows.shape[1], ptx.source, p.batch_size, cfg.ppo.ptx_coef)
    return ptx


class Stopped(Exception):
    """The run stopped on SIGTERM/SIGINT (status.json says whether it can be resumed)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run(cfg, *, overrides: Sequence[str] = ()) -> dict:
    """The job; ``overrides``: the command line's (they win over a resumed run's pool sizes)."""
    from cluster.console import quiet_console

    with quiet_console(cfg.run.library_logs) as library_log:
        return _run(cfg, overrides, library_log)


def _run(cfg, overrides: Sequence[str], library_log) -> dict:
    from cluster import checkpoint
    from cluster.driver import Driver
    from cluster.lifecycle import StopSignals, resume_source, resumed_config
    from cluster.metrics import RunMetrics
    from cluster.pools import PlacementError, create_pools

    startup = StartupClock()
    try:
        reused_dir, resume_from = resume_source(cfg)  # before loading anything it may refuse
        if resume_from is not None:  # the pools as they were scaled, unless the command line says
            cfg = resumed_config(cfg, resume_from, overrides)
        policy, tokenizer_path, tokenizer, train_set, eval_set = prepare(cfg)
        ptx = prepare_ptx(cfg, tokenizer_path)
        check_fits(cfg, policy)  # a local Ray that cannot hold the pools: refused before it starts
    except (ValueError, OSError, ImportError) as e:  # bad data / model paths / checkpoint: the user's to fix
        raise UserError(one_line(e)) from None
    startup.lap("prepare")
    if reused_dir is None:
        run_dir = make_run_dir(cfg)
    else:
        run_dir = reused_dir
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    log.info("run folder: %s (resolved config in config.yaml)", run_dir)
    log.info(startup_summary(cfg))
    write_status(run_dir, "running")
    if library_log is not None:
        library_log.open(run_dir)
    ray_logs = connect_ray(cfg)
    if library_log is not None:
        log.info(library_log.where(ray_logs))
    startup.lap("ray")
    pools = None
    try:
        try:
            pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
        except PlacementError as e:
            raise UserError(str(e)) from None
        startup.lap("pools")
        actors = pools.actor_names()
        log.info("actors: %s", ", ".join(actors))
        control, control_info = start_control(run_dir, pools)
        write_status(run_dir, "running", actors=actors, control=control_info)
        metrics = RunMetrics(run_dir=run_dir, plot_every=cfg.run.plot_every,
                             tensorboard=cfg.run.tensorboard)
        driver = Driver(cfg, pools=pools, dataset=train_set, eval_dataset=eval_set,
                        tokenizer=tokenizer, metrics=metrics, ptx=ptx, control=control)
        resumed = {}
        if resume_from is not None:
            step = driver.restore(resume_from).step
            resumed = {"resumed_from_step": step, "note": f"resumed from step {step}"}
            log.info("resumed from step %d (%s)", step, resume_from)
        elif reused_dir is not None:  # run.resume=auto before the run's first checkpoint: start over
            metrics.rewind(-1)
        driver.startup_metrics = startup.metrics()
        log.info(startup.line())
        write_status(run_dir, "running", actors=actors, control=control_info, startup=startup.seconds, **resumed)
        with StopSignals(driver.stop_requested.set) as signals:
            final = driver.run()
        if signals.received:
            path = driver.checkpoint() if driver.step_count else None
            metrics.close()
            write_status(run_dir, "stopped", step=driver.step_count, resumable=path is not None,
                         checkpoint=str(path), **resumed)
            raise Stopped(f"stopped at step {driver.step_count}; continue with: python -m cluster.train "
                          f"run.resume={run_dir}", signals.exit_code)
        final_dir = driver.save_checkpoint("final")
        metrics.close()
        write_status(run_dir, "succeeded", steps=cfg.run.steps, checkpoint=final_dir, actors=actors,
                     final={k: v for k, v in final.items() if isinstance(v, (int, float))},
                     rollbacks=driver.rollbacks, **resumed)
        return final
    except Stopped:
        raise
    except BaseException as e:
        import traceback
        (run_dir / "error.log").write_text("".join(traceback.format_exception(e)))
        if isinstance(e, KeyboardInterrupt):  # a second signal: the last periodic checkpoint stands
            latest = checkpoint.latest(run_dir)
            write_status(run_dir, "stopped", resumable=latest is not None, checkpoint=str(latest))
        else:
            write_status(run_dir, "failed", reason=one_line(e))
        raise
    finally:
        if pools is not None:
            pools.shutdown()


def start_control(run_dir: Path, pools):
    """The job's RunControl actor (python -m cluster.scale talks to it) and where to find it."""
    import hashlib

    import ray

    from cluster.control import NAMESPACE, RunControl, actor_name

    # The folder's hash keeps two runs of the same name in different run.dirs apart.
    name = actor_name(f"{run_dir.name}-{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}")
    control = ray.remote(RunControl).options(name=name, namespace=NAMESPACE, num_cpus=0).remote(
        run_dir=str(run_dir), sizes=pools.sizes())
    ray.get(control.health.remote())
    pools.extra_actors.append(control)
    return control, {"actor": name, "namespace": NAMESPACE, "address": ray.get_runtime_context().gcs_address}


def startup_summary(cfg) -> str:
    g, r, w, lp = cfg.generator, cfg.reference, cfg.reward, cfg.learner
    pool = lambda name, p: (f"{name} {p.replicas}x({p.num_cpus:g} CPU"
                            + (f", {p.num_gpus:g} GPU)" if p.num_gpus else ")"))
    return (f"{cfg.run.mode} PPO, {cfg.run.steps} steps of {cfg.data.prompts_per_step} prompts x "
            f"{g.sampling.n} samples | policy {cfg.model.policy} | reward {w.function or w.model} | "
            f"{pool('generators', g)} {pool('references', r)} {pool('rewards', w)} "
            f"{pool('learner ranks', lp)} ZeRO-{lp.zero_stage}")


def one_line(e: BaseException) -> str:
    """The last meaningful line of an error, including errors raised inside Ray actors."""
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error:" in ln or "Error(" in ln:
            return ln
    return lines[-1] if lines else type(e).__name__


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(sys.argv[1:] if argv is None else argv)  # --help needs no dependencies
    missing = missing_dependencies()
    if missing:  # e.g. `ray job submit` to a Ray started outside the venv: one line, not a traceback
        print(dependency_error(missing), file=sys.stderr)
        return 2
    from cluster.config import ConfigError, describe, load_config
    from cluster.reward_check import InvalidScores

    if args.help_config:
        print(describe())
        return 0
    from cluster.lifecycle import resume_config_file

    try:
        cfg = load_config(args.config or resume_config_file(args.overrides) or DEFAULT_CONFIG, args.overrides)
        final = run(cfg, overrides=args.overrides)
    except (ConfigError, UserError, InvalidScores, FileNotFoundError) as e:
        print(f"tether: error: {one_line(e)}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"tether: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("tether: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a failed run ends in one line, details in the log
        print(f"tether: run failed: {one_line(e)} (traceback in the run folder's error.log)",
              file=sys.stderr)
        return 1
    print(f"tether: done; reward/mean={final.get('reward/mean', float('nan')):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

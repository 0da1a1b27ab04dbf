"""The PPO service as one job: prepared inputs, a run folder, the pools, the driver's loop,
and status.json at every turn (running, stopped, succeeded, failed)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from cluster.job.errors import Stopped, UserError, one_line
from cluster.job.folder import make_run_dir, write_status
from cluster.job.startup import StartupClock, check_fits, connect_ray
from cluster.runtime.prepare import prepare, prepare_ptx

log = logging.getLogger("tether")


def run(cfg, *, overrides: Sequence[str] = ()) -> dict:
    """The job; ``overrides``: the command line's (they win over a resumed run's pool sizes)."""
    from cluster.runtime.console import quiet_console

    with quiet_console(cfg.run.library_logs) as library_log:
        return _run(cfg, overrides, library_log)


def _run(cfg, overrides: Sequence[str], library_log) -> dict:
    from cluster.runtime import checkpoint
    from cluster.runtime.driver import Driver
    from cluster.runtime.metrics import RunMetrics
    from cluster.runtime.pools import PlacementError, create_pools
    from cluster.runtime.resume import StopSignals, resume_source, resumed_config

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

    from cluster.runtime.control import NAMESPACE, RunControl, actor_name

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

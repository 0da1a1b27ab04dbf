"""The PPO service as one job: prepared inputs, a run folder, the pools, the driver's loop,
and status.json at every turn (running, stopped, succeeded, failed)."""
from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

from cluster.job.errors import Stopped, UserError
from cluster.job.folder import make_run_dir, running, write_status
from cluster.job.signals import StopSignals
from cluster.job.startup import StartupClock, check_fits, connect_ray
from cluster.runtime.observe.trackers import check_trackers, open_trackers
from cluster.runtime.prepare import prepare, prepare_ptx
from cluster.runtime.state.models import prepare_teacher
from core.modeling.architectures import unsupported_model

log = logging.getLogger("tether")


def run(cfg, *, overrides: Sequence[str] = ()) -> dict:
    """The job; ``overrides``: the command line's (they win over a resumed run's pool sizes)."""
    from cluster.runtime.observe.console import quiet_console

    with quiet_console(cfg.run.library_logs) as library_log:
        return _run(cfg, overrides, library_log)


def _run(cfg, overrides: Sequence[str], library_log) -> dict:
    from cluster.runtime.pools.launch import create_pools
    from cluster.runtime.pools.pool import PlacementError

    startup = StartupClock()
    cfg, inputs, reused_dir, resume_from = _prepare(cfg, overrides)
    startup.lap("prepare")
    run_dir = _run_folder(cfg, reused_dir)
    log.info("run folder: %s (resolved config in config.yaml)", run_dir)
    log.info(startup_summary(cfg))
    # ExitStack first: status.json and error.log are written before the pools go
    with ExitStack() as cleanup, running(run_dir, interrupted=lambda: _interrupted(run_dir)):
        if library_log is not None:
            library_log.open(run_dir)
        trackers = cleanup.enter_context(open_trackers(cfg.run, run_dir=run_dir, stage="ppo", config=cfg.to_dict()))
        ray_logs = connect_ray(cfg)
        if library_log is not None:
            log.info(library_log.where(ray_logs))
        startup.lap("ray")
        try:
            pools = create_pools(cfg, policy_path=inputs["policy"], tokenizer_path=inputs["tokenizer_path"],
                                 columns=inputs["dataset"].columns,  # the whole set's: eval prompts' too
                                 teacher_path=inputs["teacher"])
        except PlacementError as e:
            raise UserError(str(e)) from None
        except Exception as e:  # an actor that refused its model in its constructor: the user's to fix
            if (refused := unsupported_model(e)) is None:
                raise
            raise UserError(refused) from None
        cleanup.callback(pools.shutdown)
        startup.lap("pools")
        return _train(cfg, run_dir, pools, inputs, startup, trackers, reused_dir=reused_dir, resume_from=resume_from)


def _prepare(cfg, overrides: Sequence[str]) -> tuple:
    """(cfg, the prepared inputs, the run folder to reuse, the checkpoint to resume from);
    each check refuses the user's input with a UserError; any other error is a bug of ours."""
    from cluster.runtime.state.resume import resume_source, resumed_config

    reused_dir, resume_from = resume_source(cfg)  # before loading anything it may refuse
    check_trackers(cfg.run, run_dir=reused_dir or Path(cfg.run.dir) / (cfg.run.name or "run"), stage="ppo")
    if resume_from is not None:  # the pools as they were scaled, unless the command line says
        cfg = resumed_config(cfg, resume_from, overrides)
    policy, tokenizer_path, tokenizer, train_set, eval_set = prepare(cfg)
    inputs = dict(policy=policy, tokenizer_path=tokenizer_path, tokenizer=tokenizer, dataset=train_set,
                  eval_dataset=eval_set, ptx=prepare_ptx(cfg, tokenizer_path),
                  teacher=prepare_teacher(cfg, tokenizer, tokenizer_path, policy))
    check_fits(cfg, policy)  # a local Ray that cannot hold the pools: refused before it starts
    return cfg, inputs, reused_dir, resume_from


def _run_folder(cfg, reused_dir) -> Path:
    if reused_dir is None:
        return make_run_dir(cfg)
    (reused_dir / "config.yaml").write_text(cfg.to_yaml())
    return reused_dir


def _interrupted(run_dir: Path) -> dict:
    """status.json after a second signal: the last periodic checkpoint stands."""
    from cluster.runtime.state import checkpoint

    latest = checkpoint.latest(run_dir)
    return {"resumable": latest is not None, "checkpoint": str(latest)}


def _train(cfg, run_dir: Path, pools, inputs: dict, startup: StartupClock, trackers, *, reused_dir,
           resume_from) -> dict:
    """The driver's loop from the control actor to the final checkpoint, status.json at each turn."""
    from cluster.runtime.loop.driver import Driver
    from cluster.runtime.observe.metrics import RunMetrics
    from cluster.runtime.pools.launch import actor_dtypes, learner_line
    from cluster.runtime.pools.placement import actor_nodes, actors_line

    actors, nodes = pools.actor_names(), actor_nodes(pools)
    log.info("actors: %s", actors_line(nodes))
    control, control_info = start_control(run_dir, pools)
    dtypes = actor_dtypes(pools)
    log.info(learner_line(pools))
    write_status(run_dir, "running", actors=actors, nodes=nodes, control=control_info, dtypes=dtypes)
    metrics = RunMetrics(run_dir=run_dir, plot_every=cfg.run.plot_every, trackers=trackers)
    driver = Driver(cfg, pools=pools, dataset=inputs["dataset"], eval_dataset=inputs["eval_dataset"],
                    tokenizer=inputs["tokenizer"], metrics=metrics, ptx=inputs["ptx"], control=control)
    resumed = {}
    if resume_from is not None:
        step = driver.restore(resume_from).step
        resumed = {"resumed_from_step": step, "note": f"resumed from step {step}"}
        log.info("resumed from step %d (%s)", step, resume_from)
    elif reused_dir is not None:  # run.resume=auto before the run's first checkpoint: start over
        metrics.rewind(-1)
    driver.startup_metrics = startup.metrics()
    log.info(startup.line())
    write_status(run_dir, "running", actors=actors, nodes=nodes, control=control_info, startup=startup.seconds,
                 dtypes=dtypes, **resumed)
    with StopSignals(driver.stop_requested.set) as signals:
        final = driver.run()
    if signals.received:
        path = driver.checkpoint() if driver.step_count else None
        metrics.close("stopped")
        write_status(run_dir, "stopped", step=driver.step_count, resumable=path is not None,
                     checkpoint=str(path), **resumed)
        raise Stopped(f"stopped at step {driver.step_count}; continue with: python -m cluster.train "
                      f"run.resume={run_dir}", signals.exit_code, run_dir=run_dir)
    final_dir = driver.save_checkpoint("final")
    metrics.close("finished", checkpoint=final_dir)
    # where the actors are now: a lost replica's replacement may run elsewhere
    write_status(run_dir, "succeeded", steps=cfg.run.steps, checkpoint=final_dir, actors=pools.actor_names(),
                 nodes=actor_nodes(pools), dtypes=dtypes,
                 final={k: v for k, v in final.items() if isinstance(v, (int, float))},
                 rollbacks=driver.rollbacks, **resumed)
    return final


def start_control(run_dir: Path, pools):
    """The job's RunControl actor (python -m cluster.scale talks to it) and where to find it."""
    import hashlib

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from cluster.runtime.pools.control import NAMESPACE, RunControl, actor_name

    # The folder's hash keeps two runs of the same name in different run.dirs apart.
    name = actor_name(f"{run_dir.name}-{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}")
    # On the driver's own node: the driver calls it between every two steps, and a node lost with it
    # would end the run; the driver's node lost ends the job anyway (resubmitting resumes it).
    beside_driver = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    control = ray.remote(RunControl).options(name=name, namespace=NAMESPACE, num_cpus=0,
                                             scheduling_strategy=beside_driver).remote(
        run_dir=str(run_dir), sizes=pools.sizes())
    ray.get(control.health.remote())
    pools.extra_actors.append(control)
    return control, {"actor": name, "namespace": NAMESPACE, "address": ray.get_runtime_context().gcs_address}


def startup_summary(cfg) -> str:
    from actors.rewards.source import reward_pool_replicas, reward_source

    g, r, w, lp = cfg.generator, cfg.reference, cfg.reward, cfg.learner
    pool = lambda name, p: (f"{name} {p.replicas}x({p.num_cpus:g} CPU"
                            + (f", {p.num_gpus:g} GPU)" if p.num_gpus else ")"))
    source = reward_source(cfg)
    reward = source.summary
    if cfg.teacher.enabled:
        reward += f" | teacher {cfg.teacher.model} (coef {cfg.teacher.coef:g})"
    if cfg.env.agent:
        reward += f" | episodes of agent {cfg.env.agent}, within {cfg.env.episode_timeout_s:g} s"
    elif cfg.env.enabled:
        reward += f" | episodes of {cfg.env.environment}, up to {cfg.env.max_turns} turns"
    return (f"{cfg.run.mode} PPO, {cfg.run.steps} steps of {cfg.data.prompts_per_step} prompts x "
            f"{g.sampling.n} samples | policy {cfg.model.policy} | reward {reward} | "
            f"{pool('generators', g)} {'reference on learner-0' if r.on_learner else pool('references', r)} "
            + (f"{pool('rewards', w)} " if reward_pool_replicas(cfg) else "")
            + f"{pool('learner ranks', lp)} ZeRO-{lp.zero_stage}")

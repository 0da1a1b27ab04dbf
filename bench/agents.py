"""An agent program's episodes through the gateway against an environment's episodes and single
responses: the same task, prompts, samples and token budget, each through a whole run.

    .venv/bin/python -m bench.agents [--steps 6] [--workers 2 8]

The two-turn arithmetic game three ways, each a sync run of ``--steps`` steps on one generator:
  - single: one response per sample (configs/arith-tiny.yaml's task at the game's sampling);
  - environment: the game's environment in worker processes (configs/arith-episodes-tiny.yaml);
  - agent-W: the same game played by an agent program through the run's gateway, W agent
    processes per generator, each playing up to 64 episodes at once (configs/arith-agent-tiny.yaml,
    env.workers=W).
Played with the same seeds, the environment's and the agent's first steps sample the same
tokens. Prints, per side, the median over steps 2.. of the generation seconds per step,
episodes (rollouts) per second and the policy's trained tokens per second, and for the agent
the calls per second and the seconds per call the gateway adds over the environment; writes
runs/bench/agents.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cluster import train
from cluster.config.ppo import CONFIGS

EPISODES = 16 * 8  # a step's: the configs' data.prompts_per_step x generator.sampling.n
GAME = ["run.eval_every=0", "run.samples_every=0", "run.plot_every=0", "run.checkpoint_every=0"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 8], help="env.workers of the agent sides")
    ap.add_argument("--out", default="runs/bench/agents.json")
    return ap.parse_args(argv)


def sides(workers: list[int]) -> dict[str, list[str]]:
    episodes = ["--config", str(CONFIGS / "arith-episodes-tiny.yaml")]
    single = ["--config", str(CONFIGS / "arith-tiny.yaml"), "generator.sampling.n=8",
              "generator.sampling.max_new_tokens=8", "data.prompts_per_step=16", "generator.replicas=1"]
    out = {"single": single, "environment": episodes}
    for w in workers:
        out[f"agent-{w}"] = ["--config", str(CONFIGS / "arith-agent-tiny.yaml"), f"env.workers={w}"]
    return out


def run_side(argv: list[str], steps: int, folder: Path, name: str) -> dict:
    assert train.main([*argv, *GAME, f"run.steps={steps}", f"run.dir={folder}", f"run.name={name}"]) == 0
    rows = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 1]  # step 1 warms the engine and the workers up
    med = lambda key: statistics.median(r.get(key, 0.0) for r in rows)  # noqa: E731
    seconds, rollouts = med("perf/generate_seconds"), EPISODES
    calls = med("agent/calls_per_session") * med("agent/sessions")
    return {"generate_s": seconds, "rollouts_per_s": rollouts / seconds, "calls_per_s": calls / seconds,
            "policy_tokens_per_s": med("learner/tokens") / seconds, "reward": med("reward/mean")}


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, side_argv in sides(args.workers).items():
            results[name] = run_side(side_argv, args.steps, Path(tmp), name)
    env = results["environment"]
    print(f"{'side':<12} {'gen s/step':>10} {'episodes/s':>10} {'calls/s':>8} {'policy tok/s':>12} "
          f"{'vs environment':>14}")
    for name, r in results.items():
        print(f"{name:<12} {r['generate_s']:>10.2f} {r['rollouts_per_s']:>10.1f} {r['calls_per_s']:>8.1f} "
              f"{r['policy_tokens_per_s']:>12.0f} {env['generate_s'] / r['generate_s']:>13.2f}x")
    for name, r in results.items():
        if name.startswith("agent") and r["calls_per_s"]:
            calls = r["calls_per_s"] * r["generate_s"]
            print(f"{name}: {1000 * (r['generate_s'] - env['generate_s']) / calls:.1f} ms per call over the "
                  f"environment's turns ({calls:.0f} calls a step)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

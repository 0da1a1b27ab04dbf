"""tether against Hugging Face TRL's PPO trainer on one workload.

    .venv/bin/python -m bench.vs_trl                                   # the full workload
    .venv/bin/python -m bench.vs_trl --prompts 4 --new-tokens 8 --steps 1   # smoke: minutes
    .venv/bin/python -m bench.vs_trl --print-command                   # tether's side by hand
    .venv/bin/python -m bench.vs_trl --dtype bfloat16                  # both sides in bf16
    .venv/bin/python -m bench.vs_trl --ragged                          # responses end at EOS, spread lengths

Builds the workload (bench/workload.py), makes TRL's virtualenv on first use
(.bench-venv-trl, pinned by constraints/bench-trl.txt), then runs in rounds, interleaved:
TRL, tether learner.critic=separate (TRL's models: value = a copy of the reward model),
tether with the default shared-body value head; each run is one warm-up step plus
--steps timed steps. Prints the medians (step seconds, where the time goes, rollout
tokens/s, start-up, peak RSS per actor), the ratios, and writes runs/bench/vs_trl.json.
--dtype sets both sides' precision: tether's model.dtype, and TRL in its best CPU
configuration at that precision (fp32 weights under bf16 autocast for its PPO epochs, its
generation and its scoring). The record starts with this machine's fp32 and bf16 matmul
peaks, measured in the same run (bench/peak.py).
--ragged: the policy (bench/stopping_policy.py) ends its responses at EOS at spread lengths
(mean about half the budget, some cut at it), sampled so on both sides: tether stops at EOS
(generator.sampling.ignore_eos=false), TRL with stop_token="eos"; the record then gives each
side's response tokens per step, since the two samplers draw different lengths.
Figures mean something only on a quiet machine: the record keeps the load average.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.procmem import PeakMemory

ROOT = Path(__file__).resolve().parent.parent
TRL_VENV = ROOT / ".bench-venv-trl"
TRL_PINS = ROOT / "constraints" / "bench-trl.txt"
PHASES = ("generate", "score", "learn", "sync", "other")


class BenchError(Exception):
    """A user-facing failure: one line, exit 2 (bad flags) or 1 (a run failed)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="timed PPO steps per run, after one warm-up step")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (TRL, tether, TRL, tether, ...)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per PPO step (one response each)")
    ap.add_argument("--new-tokens", type=int, default=128, help="response tokens per prompt (no EOS stop)")
    ap.add_argument("--sides", default="trl,separate,shared",
                    help="which runs: trl, separate, shared, none (tether with no critic: ppo.advantage=reinforce_pp)")
    ap.add_argument("--pool-cpus", default=None,
                    help="tether pool CPUs, e.g. generator=8,learner=4 (default: as shipped, no hand-tuning)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both sides' precision (tether: model.dtype; TRL: bf16 autocast)")
    ap.add_argument("--ragged", action="store_true",
                    help="a policy that ends its responses at EOS at spread lengths, on both sides")
    ap.add_argument("--out", default="runs/bench/vs_trl.json")
    ap.add_argument("--print-command", action="store_true", help="print tether's cluster.train command and exit")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.new_tokens < 1 or args.prompts < 4 or args.prompts % 4:
        raise BenchError("--steps, --rounds and --new-tokens must be >= 1 and --prompts a multiple of 4 "
                         "(4 minibatches per epoch)", 2)
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not args.sides or set(args.sides) - set(LABELS):
        raise BenchError(f"--sides={','.join(args.sides)}: use a comma list of {', '.join(LABELS)}", 2)
    return args


def parse_pool_cpus(text: str | None) -> dict[str, int]:
    """Pool CPU overrides; none by default: tether runs as shipped (bench-30m.yaml, and in sync
    mode the running phase gets the machine's cores: cluster/runtime/pools/threads.py)."""
    cpus, pools = {}, ("generator", "reference", "reward", "learner")
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, _, value = item.partition("=")
        if key.strip() not in pools or not value.strip().isdigit() or int(value) < 1:
            raise BenchError(f"--pool-cpus: {item!r} is not POOL=N with POOL in {list(pools)} and N >= 1", 2)
        cpus[key.strip()] = int(value)
    return cpus


# ---------------------------------------------------------------------------- TRL side
def trl_python() -> Path:
    """TRL's own virtualenv, made (pinned) on first use and when the pins change."""
    python, stamp = TRL_VENV / "bin" / "python", TRL_VENV / ".bench-pins"
    want = hashlib.sha256(TRL_PINS.read_bytes()).hexdigest()[:16]
    if python.exists() and stamp.exists() and stamp.read_text() == want:
        return python
    print(f"bench: creating {TRL_VENV.name} (trl 1.12, torch 2.13.0 CPU; a few minutes, once)", file=sys.stderr)
    steps = [[sys.executable, "-m", "venv", str(TRL_VENV)],
             [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", str(TRL_PINS),
              "torch==2.13.0", "trl==1.12.*"]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()
            raise BenchError(f"bench: {' '.join(cmd[:4])} failed: {tail[-1] if tail else done.returncode}")
    stamp.write_text(want)
    return python


def run_trl(workload: Path, args, n_steps: int) -> dict:
    cmd = [str(trl_python()), str(ROOT / "bench" / "trl_ppo_step.py"), "--workload", str(workload),
           "--steps", str(n_steps), "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens),
           "--dtype", args.dtype, *(["--ragged"] if args.ragged else [])]
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out, mem, wall = run_command(cmd, env, "TRL")
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{\"")]
    steps = [r for r in records if "step" in r]
    done = next((r for r in records if r.get("done")), {})
    startup = next((r["startup_seconds"] for r in records if "startup_seconds" in r), None)
    return {"steps": steps, "startup_seconds": startup, "wall_seconds": wall, "memory": mem,
            "torch_threads": done.get("torch_threads")}


# ---------------------------------------------------------------------------- tether side
def tether_command(wl: dict, args, critic: str, cpus: dict, n_steps: int, run_dir: Path,
                   extra: tuple = ()) -> list[str]:
    o = [f"model.policy={wl['policy']}", "reward.function=null", f"reward.model={wl['reward']}", "reward.batch_size=64",
         f"data.path={wl['prompts_path']}", f"data.prompts_per_step={args.prompts}",
         f"generator.sampling.max_new_tokens={args.new_tokens}",
         f"generator.engine.max_model_len={_pow2(wl['prompt_tokens'] + args.new_tokens)}",
         f"generator.engine.max_num_seqs={max(args.prompts, 1)}",
         f"ppo.minibatch_size={args.prompts // 4}", f"ppo.micro_batch_size={args.prompts // 4}",
         f"learner.critic={critic}", f"model.dtype={args.dtype}",
         f"run.steps={n_steps}", f"run.dir={run_dir.parent}", f"run.name={run_dir.name}",
         *(f"{pool}.num_cpus={n}" for pool, n in cpus.items())]
    if critic == "separate":
        o.append(f"learner.critic_model={wl['value']}")
    if critic == "none":  # critic-free: the same update without a value model (no groups: n=1 here)
        o.append("ppo.advantage=reinforce_pp")
    if args.ragged:  # responses end where the policy samples EOS
        o.append("generator.sampling.ignore_eos=false")
    return [sys.executable, "-m", "cluster.train", "--config", str(ROOT / "configs" / "bench-30m.yaml"), *o, *extra]


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def run_tether(wl: dict, args, critic: str, cpus: dict, n_steps: int, run_dir: Path, extra: tuple = ()) -> dict:
    """One tether run of the workload (``extra``: more cluster.train overrides), its steps' phases and memory."""
    cmd = tether_command(wl, args, critic, cpus, n_steps, run_dir, extra)
    t_launch = time.time()
    _, mem, wall = run_command(cmd, {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")},
                        f"tether critic={critic}")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    first = next(m for m in lines if m["step"] == 0)
    steps = []
    for m in (m for m in lines if m["step"] >= 1):
        phase = {p: m[f"perf/{p}_seconds"] for p in ("generate", "score", "learn", "sync")}
        phase["buffer_wait"] = m.get("perf/buffer_wait_seconds", 0.0)
        steps.append({"step": m["step"], "step_seconds": m["perf/step_seconds"],
                      **{f"{p}_seconds": v for p, v in phase.items()},
                      "tokens": round(m["perf/tokens_per_s"] * m["perf/generate_seconds"]),
                      "response_length_mean": m.get("response/length_mean")})
    startup = {k[len("perf/startup_"):-len("_seconds")]: v for k, v in first.items()
               if k.startswith("perf/startup_") and k != "perf/startup_seconds"}
    return {"steps": steps, "startup_seconds": first["time"] - t_launch, "startup_phases": startup,
            "wall_seconds": wall, "memory": mem, "run_dir": str(run_dir)}


# ---------------------------------------------------------------------------- shared
def run_command(cmd: list[str], env: dict, what: str) -> tuple[str, dict, float]:
    """Run a side to completion, sampling its process tree's peak RSS; its log goes to stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    with PeakMemory(proc.pid) as mem:
        for line in proc.stdout:
            out.append(line)
            if not line.startswith("{\""):
                print(f"  [{what}] {line.rstrip()}", file=sys.stderr)
        code = proc.wait()
    if code:
        last = next((ln.strip() for ln in reversed(out) if ln.strip()), f"exit code {code}")
        raise BenchError(f"bench: {what} failed (exit {code}): {last}")
    return "".join(out), mem.by_role(), time.perf_counter() - t0


def summarise(runs: list[dict], new_tokens: int, prompts: int) -> dict:
    """Medians over every timed step (the first step of each run is the warm-up)."""
    timed = [s for r in runs for s in r["steps"][1:]]
    med = lambda key: statistics.median(s.get(key, 0.0) for s in timed) if timed else float("nan")
    out = {"timed_steps": len(timed), "step_seconds": med("step_seconds")}
    for p in ("generate", "score", "learn", "sync", "buffer_wait"):
        out[f"{p}_seconds"] = med(f"{p}_seconds")
    # driver and queue overhead: the step less its four phases (buffer_wait included here)
    out["other_seconds"] = statistics.median(
        s["step_seconds"] - sum(s.get(f"{p}_seconds", 0.0) for p in ("generate", "score", "learn", "sync"))
        for s in timed) if timed else float("nan")
    out["rollout_tokens_per_s"] = statistics.median(s["tokens"] / s["generate_seconds"] for s in timed) if timed else 0
    out["tokens_per_step"] = statistics.median(s["tokens"] for s in timed) if timed else 0
    out["expected_tokens_per_step"] = prompts * new_tokens
    out["startup_seconds"] = statistics.median(r["startup_seconds"] for r in runs if r["startup_seconds"] is not None)
    phases = [r["startup_phases"] for r in runs if r.get("startup_phases")]
    if phases:  # tether's own account of its start-up, by phase
        out["startup_phases"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
    memory = {}
    for r in runs:
        for role, m in r["memory"].items():
            memory[role] = max(memory.get(role, 0), m["peak_rss_bytes"])
    out["peak_rss_bytes"] = memory
    return out


LABELS = {"trl": "TRL 1.12 PPOTrainer", "separate": "tether critic=separate", "shared": "tether critic=shared",
          "none": "tether critic=none"}


def work_floor(trl: dict) -> dict:
    """tether's step over TRL's if tether did each piece of its work exactly as fast as TRL
    does the same piece, from TRL's measured phases (g generate, s score, l learn).

    Both sample the same tokens (g) and run three no-grad forwards of the batch: TRL's
    reference, value and reward forwards (s); tether's reference and reward forwards plus
    the learner's old-value forward (bench-30m takes pi_old from the sampler, as TRL does).
    TRL's epochs train two bodies (policy and value model), as critic=separate does; the
    shared value head trains one, so half of l. Below these ratios tether must beat TRL's
    kernels on the same arithmetic, not skip work.
    """
    gen, score, learn = (trl[f"{p}_seconds"] for p in ("generate", "score", "learn"))
    return {"separate": 1.0, "shared": (gen + score + learn / 2) / (gen + score + learn)}


def report(summary: dict, ragged: bool = False) -> str:
    head = (f"{'':24}{'step s':>8}{'gen':>7}{'score':>7}{'learn':>7}{'sync':>7}{'other':>7}{'sync %':>7}"
            f"{'tok/s':>8}{'start s':>9}")
    rows = [head]
    for side, s in summary.items():
        rows.append(f"{LABELS[side]:24}{s['step_seconds']:8.2f}" + "".join(f"{s[f'{p}_seconds']:7.2f}" for p in PHASES)
                    + f"{100 * s['sync_seconds'] / s['step_seconds']:7.1f}"
                    + f"{s['rollout_tokens_per_s']:8.0f}{s['startup_seconds']:9.1f}")
    rows += ratio_rows(summary, ragged)
    rows.append("peak RSS per actor (MiB):")
    for side, s in summary.items():
        mem = ", ".join(f"{role} {b / 2**20:.0f}" for role, b in sorted(s["peak_rss_bytes"].items()))
        rows.append(f"  {LABELS[side]}: {mem}")
    for side, s in summary.items():
        if ragged:
            rows.append(f"{LABELS[side]}: {s['tokens_per_step']} response tokens a step "
                        f"({s['tokens_per_step'] / s['expected_tokens_per_step']:.2f} of the budget)")
        elif s["tokens_per_step"] != s["expected_tokens_per_step"]:
            rows.append(f"warning: {LABELS[side]} generated {s['tokens_per_step']} tokens a step, not "
                        f"{s['expected_tokens_per_step']} (responses stopped early?)")
    return "\n".join(rows)


def ratio_rows(summary: dict, ragged: bool) -> list[str]:
    """Each tether side against TRL, with the equal-speed floor where both do the same work
    (not on the ragged workload: TRL pads every batch to its longest response, tether packs)."""
    if "trl" not in summary:
        return []
    floor, t, rows = work_floor(summary["trl"]), summary["trl"], []
    for side in [s for s in ("separate", "shared", "none") if s in summary]:
        s = summary[side]
        bound = "" if ragged or side not in floor else f" (equal-speed work floor {floor[side]:.2f}x)"
        rows.append(f"ratio TRL/{LABELS[side]}: step time {t['step_seconds'] / s['step_seconds']:.2f}x, "
                    f"rollout tokens/s {s['rollout_tokens_per_s'] / t['rollout_tokens_per_s']:.2f}x; "
                    f"{LABELS[side]}/TRL {s['step_seconds'] / t['step_seconds']:.2f}x{bound}")
    return rows


def matmul_peaks() -> dict[str, float]:
    """This machine's fp32 and bf16 matmul FLOP/s with all its cores, measured now."""
    import torch

    from bench.peak import matmul_peak
    return {name: matmul_peak(torch.device("cpu"), getattr(torch, name))["flops_per_s"]
            for name in ("float32", "bfloat16")}


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        cpus = parse_pool_cpus(args.pool_cpus)
        from bench.workload import build_workload
        wl_path = build_workload(prompts=max(256, 4 * args.prompts), ragged=args.ragged)
        wl = json.loads(wl_path.read_text())
        stamp = time.strftime("%Y%m%d-%H%M%S")
        n_steps = 1 + args.steps
        if args.print_command:
            print(shlex.join(tether_command(wl, args, "shared", cpus, n_steps, ROOT / "runs" / "bench" / "by-hand")))
            return 0
        load_before = os.getloadavg()
        if load_before[0] > 0.5:
            print(f"bench: load average {load_before[0]:.2f} (> 0.5): the figures are not meaningful", file=sys.stderr)
        peaks = matmul_peaks()
        print("bench: matmul peak " + ", ".join(f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items()),
              file=sys.stderr)
        runs: dict[str, list] = {side: [] for side in args.sides}
        for rnd in range(args.rounds):
            for side in args.sides:
                print(f"bench: round {rnd + 1}/{args.rounds}: {LABELS[side]}", file=sys.stderr)
                if side == "trl":
                    runs[side].append(run_trl(wl_path, args, n_steps))
                else:
                    run_dir = ROOT / "runs" / "bench" / f"vs_trl-{stamp}-{side}-{rnd}"
                    runs[side].append(run_tether(wl, args, side, cpus, n_steps, run_dir))
        summary = {side: summarise(r, args.new_tokens, args.prompts) for side, r in runs.items()}
        text = report(summary, args.ragged) + f"\n({args.dtype}; matmul peak " + ", ".join(
            f"{d} {p / 1e9:.0f} GFLOP/s" for d, p in peaks.items()) + ")"
        print(text)
        record = {"time": stamp, "host": platform.node(), "cpus": os.cpu_count(), "load_before": load_before,
                  "matmul_peak_flops_per_s": peaks,
                  "load_after": os.getloadavg(), "args": {k: v for k, v in vars(args).items() if k != "print_command"},
                  "pool_cpus": cpus, "workload": {k: v for k, v in wl.items() if k != "prompt_ids"},
                  "summary": summary, "runs": runs, "report": text,
                  "work_floor": work_floor(summary["trl"]) if "trl" in summary and not args.ragged else None}
        out = ROOT / args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, default=float))
        print(f"record: {out}")
        return 0
    except BenchError as e:
        print(str(e), file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())

"""The learner's PPO update against a plain-torch loop doing the same work.

    .venv/bin/python -m bench.learner                       # the workload's 31.7M policy, critic=separate
    .venv/bin/python -m bench.learner --critic shared --threads 1 --zero 0 2
    .venv/bin/python -m bench.learner --rollouts 8 --new-tokens 8 --repeats 1    # smoke
    .venv/bin/python -m bench.learner --ragged --sides tether,tether-packed,tether-packed-masked
    python -m bench.learner --device cuda --dtype bfloat16 --policy-size large --critic shared --zero 2 3

Both sides, in this one process and with the same torch threads, train the same model
(learner.policy.PolicyWithValueHead on the workload's policy, plus the reward model's
copy as a separate critic) on the same batch of scored rollouts with the same minibatch
schedule: one no-grad forward for the old log-probs and values, then ppo_epochs x
minibatches of forward, clipped policy + value loss, backward and an AdamW step.

  - torch: the loop written out by hand with torch.optim.AdamW (fused, as tether builds it), no DeepSpeed;
  - tether: learner.worker.LearnerWorker (one rank, DeepSpeed ZeRO, as a run uses it);
  - tether-packed: the same with ppo.packing (padding-free micro-batches, varlen attention:
    core/modeling/varlen_attention.py); tether-packed-masked: packed rows on sdpa's block-diagonal
    mask instead (what ppo.packing ran before varlen attention), to tell the two apart.

--ragged: responses of 8 to 256 tokens ending at EOS, prompts of 8 to 128 (seeded; the
workload's prompts end to end, cut), where packing has padding to drop; without it every
response is exactly --new-tokens long and every prompt the workload's 16 tokens.

--dtype bfloat16: tether runs learner.dtype=bfloat16 (DeepSpeed bf16: bf16 weights and activations,
fp32 master weights in the optimizer); the torch side keeps fp32 weights and runs its forwards
under torch.autocast(bfloat16). --device cuda puts both sides on cuda:0 (DeepSpeed's CUDA
accelerator) and times them with the device synchronized. --policy-size mid|large swaps in a
bigger random-weight Qwen2 (bench/sizes.py), for a GPU.

Prints seconds per update (median of --repeats rounds after a warm-up round; the sides
take turns within each round), each side's peak RSS during its updates (the kernel's
high-water mark, reset before each: the process holds every side's model meanwhile) and
padding fraction (perf/learner_padding_frac), the ratio, the matmul peak measured on this device at this
dtype and each side's FLOP/s and MFU against it (bench/peak.py says what is counted),
and writes runs/bench/learner.json. Figures mean something only on a quiet machine.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.peak import matmul_peak, mfu_line, sync, timed, trainable_params, update_flops
from bench.procmem import peak_rss_bytes, rss_bytes

# --dtype: (tether's learner.dtype, the torch side's autocast dtype or None for plain fp32)
DTYPES = {"float32": ("float32", None), "bfloat16": ("bfloat16", torch.bfloat16)}
# --sides: the plain-torch loop, then tether's learner padded, packed, and packed on masked sdpa
SIDES = ("torch", "tether", "tether-packed", "tether-packed-masked")
RAGGED_PROMPT, RAGGED_RESPONSE = (8, 128), (8, 256)  # --ragged: token counts, both ends included


def parse_args(argv):
    from bench.sizes import SIZES

    ap = argparse.ArgumentParser(prog="python -m bench.learner", description=__doc__.split("\n")[0])
    ap.add_argument("--critic", choices=("separate", "shared"), default="separate")
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--zero", type=int, nargs="+", default=[0], choices=(0, 1, 2, 3),
                    help="ZeRO stage(s) of the tether side; several give one tether side each")
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per side, after one warm-up update")
    ap.add_argument("--sides", default="torch,tether", help=f"a comma list of {', '.join(SIDES)}")
    ap.add_argument("--ragged", action="store_true",
                    help="responses of 8-256 tokens ending at EOS, prompts of 8-128 (else --new-tokens each)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                    help="bfloat16: tether's learner.dtype=bfloat16 (fp32 master weights), torch under autocast")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="both sides on this device")
    ap.add_argument("--policy-size", choices=tuple(SIZES), default="bench",
                    help="bench: the workload's 31.7M policy; mid ~0.17B, large ~0.49B (Qwen2.5-0.5B's shape)")
    ap.add_argument("--out", default="runs/bench/learner.json")
    args = ap.parse_args(argv)
    if min(args.rollouts, args.new_tokens, args.epochs, args.minibatches, args.threads, args.repeats) < 1:
        ap.exit(2, "python -m bench.learner: error: every count must be >= 1\n")
    if args.rollouts % args.minibatches:
        ap.exit(2, f"python -m bench.learner: error: --rollouts {args.rollouts} must be a multiple of "
                   f"--minibatches {args.minibatches}\n")
    args.sides = [s for s in args.sides.split(",") if s]
    if not args.sides or set(args.sides) - set(SIDES):
        ap.exit(2, f"python -m bench.learner: error: --sides takes a comma list of {', '.join(SIDES)}\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.exit(2, "python -m bench.learner: error: --device cuda, but torch sees no CUDA device\n")
    return args


def use_device(name: str) -> torch.device:
    """Point both sides at ``name``: DeepSpeed picks its accelerator from DS_ACCELERATOR once, when
    it is first imported, and the learner takes cuda:0 whenever CUDA is visible, so --device cpu
    hides the GPUs (before anything initialises CUDA) rather than let the tether side use one."""
    if name == "cuda":
        os.environ["DS_ACCELERATOR"] = "cuda"
        return torch.device("cuda", 0)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    return torch.device("cpu")


def rollouts(wl: dict, n: int, new_tokens: int, ragged: bool = False) -> list:
    """n scored rollouts: exactly new_tokens random response tokens after the workload's prompts,
    or (``ragged``) ``ragged_rollouts``."""
    from core.annotate import annotate
    from core.rollout import Rollout

    rng = np.random.default_rng(0)
    if ragged:
        out = ragged_rollouts(wl, n, rng)
    else:
        prompts = wl["prompt_ids"]
        out = [Rollout(prompt_ids=prompts[i % len(prompts)], response_ids=rng.integers(3, wl["vocab_size"], new_tokens),
                       behaviour_logprobs=-rng.uniform(5.5, 6.9, new_tokens), finish_reason="length",
                       policy_version=0, prompt_index=i, sample_index=0) for i in range(n)]
    refs = [r.behaviour_logprobs + rng.normal(0, 0.05, r.response_ids.size).astype(np.float32) for r in out]
    return annotate(out, refs, rng.normal(size=n).astype(np.float32), beta=0.05, kl_estimator="k1")


def ragged_rollouts(wl: dict, n: int, rng: np.random.Generator) -> list:
    """n rollouts of RAGGED_PROMPT prompt tokens (a stretch of the workload's prompts laid end to
    end: real text ids) and RAGGED_RESPONSE random response tokens, the last one EOS (stopped)."""
    from core.rollout import Rollout

    text = np.concatenate([np.asarray(p) for p in wl["prompt_ids"]])
    eos, out = wl["eos_token_id"], []
    for i in range(n):
        p, r = (rng.integers(lo, hi + 1) for lo, hi in (RAGGED_PROMPT, RAGGED_RESPONSE))
        start = rng.integers(0, text.size - p)
        response = rng.integers(3, wl["vocab_size"] - 1, r)
        response[response >= eos] += 1  # anything but EOS before the end
        response[-1] = eos
        out.append(Rollout(prompt_ids=text[start:start + p], response_ids=response,
                           behaviour_logprobs=-rng.uniform(5.5, 6.9, r), finish_reason="stop",
                           policy_version=0, prompt_index=i, sample_index=0))
    return out


def config(args, wl: dict, zero_stage: int) -> dict:
    """The learner config of bench-30m.yaml (TRL's PPO settings) at this batch size and dtype."""
    mb = args.rollouts // args.minibatches
    return {"zero_stage": zero_stage, "critic": args.critic, "dtype": DTYPES[args.dtype][0],
            "critic_model": wl["value"] if args.critic == "separate" else None,
            "optim": {"lr": 1e-5, "betas": [0.9, 0.999], "warmup_steps": 0, "decay": "constant", "grad_clip": 0.0},
            "ppo": {"ppo_epochs": args.epochs, "minibatch_size": mb, "micro_batch_size": mb, "clip_low": 0.2,
                    "value_clip": 0.2, "vf_coef": 0.1, "entropy_coef": 0.0, "gamma": 1.0, "lam": 0.95}}


def torch_side(args, wl: dict, batch_rollouts: list, device: torch.device):
    """The same update as a hand-written loop: AdamW, no DeepSpeed, no stats, no collectives.
    Returns (a callable doing one update and returning its seconds, the trainable parameters)."""
    from core.advantages import gae
    from core.masked import whiten
    from learner.batch import collate
    from learner.policy import PolicyWithValueHead

    model = PolicyWithValueHead.from_pretrained(wl["policy"], critic=args.critic,
                                                critic_model=wl["value"] if args.critic == "separate" else None)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, fused=True)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    mb = args.rollouts // args.minibatches
    cast = DTYPES[args.dtype][1]
    # bf16 the usual torch way: fp32 weights and optimizer, forwards autocast (log-softmax stays fp32).
    forward = lambda mic, **kw: _autocast(device, cast, model.response_logprobs_values, mic, **kw)  # noqa: E731

    def update() -> float:
        sync(device)
        t0 = time.perf_counter()
        b = collate(batch_rollouts, pad).to(device)
        m = b.response_mask
        with torch.no_grad():
            old_lp, old_v, _ = forward(b, with_entropy=False)
            old_lp, old_v = old_lp * m, old_v * m
            adv, ret = gae(b.rewards, old_v, m, 1.0, 0.95)
            adv = whiten(adv.double(), m).float()
        n_tok = float(m.sum()) / args.minibatches
        for epoch in range(args.epochs):
            order = np.random.default_rng([0, epoch]).permutation(len(b))
            for k in range(args.minibatches):
                rows = torch.as_tensor(order[k * mb:(k + 1) * mb], device=device)
                _torch_step(forward, b[rows].trimmed(), old_lp[rows], old_v[rows], adv[rows], ret[rows],
                            n_tok, mb)
                opt.step()
                opt.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    return update, trainable_params(model)


def _autocast(device: torch.device, cast, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under autocast to ``cast`` (None: as it is, fp32)."""
    with torch.autocast(device.type, dtype=cast) if cast is not None else contextlib.nullcontext():
        return fn(*args, **kwargs)


def _torch_step(forward, mic, old_lp, old_v, adv, ret, n_tok: float, mb: int) -> None:
    """One minibatch's clipped policy + value loss and its backward (outside autocast, as torch advises)."""
    from core import ppo

    lp, v, _ = forward(mic, with_entropy=True)
    mm = mic.response_mask
    R = mm.shape[1]
    agg = ppo.Aggregation(mode="token-mean", global_tokens=n_tok, global_seqs=float(mb), horizon=R)
    pg, _, _ = ppo.policy_loss(lp, old_lp[:, :R], adv[:, :R], mm, 0.2, 0.2, None, agg)
    vf, _ = ppo.value_loss(v, old_v[:, :R], ret[:, :R], mm, 0.2, agg)
    (pg + 0.1 * vf).backward()


def tether_side(args, wl: dict, batch_rollouts: list, zero_stage: int, device: torch.device, side: str):
    """tether's learner as ``side`` (tether, tether-packed, tether-packed-masked) runs it."""
    from learner.worker import LearnerWorker

    cfg = config(args, wl, zero_stage)
    cfg["ppo"]["packing"] = side != "tether"
    worker = LearnerWorker(rank=0, world_size=1, model=wl["policy"], config=cfg)
    module = worker.engine.module
    if side == "tether-packed-masked":  # back to sdpa: packed rows on its block-diagonal mask
        for body in (module.lm, module.critic_body):
            if body is not None:
                body.set_attn_implementation("sdpa")
    params, metrics = trainable_params(module), []

    def update() -> tuple[float, float]:
        if device.type == "cuda":  # the update's own clock stops before its last kernels have run
            seconds = timed(lambda: metrics.append(worker.train(batch_rollouts)), device)
        else:
            metrics.append(worker.train(batch_rollouts))
            seconds = metrics[-1]["perf/learner_seconds"]
        return seconds, metrics[-1]["perf/learner_padding_frac"]

    return update, params


def build_sides(args, wl: dict, batch: list, device: torch.device) -> tuple[dict, int]:
    """{side name: update callable -> (seconds, padding fraction or None)}, and the trainable
    parameters they train (the same model)."""
    updates, params = {}, 0
    for side in args.sides:
        if side == "torch":
            update, params = torch_side(args, wl, batch, device)
            updates["torch"] = lambda update=update: (update(), None)
        for stage in (args.zero if side != "torch" else []):
            updates[f"{side}-z{stage}"], params = tether_side(args, wl, batch, stage, device, side)
    return updates, params


def run_rounds(args, updates: dict) -> dict:
    """{side: {"seconds": [timed], "peak_rss": bytes, "rss_rise": bytes, "padding_frac": float or
    None}}: the peak RSS during a side's updates, and its rise over the RSS at an update's start
    (what the update itself allocated: activations, gradients) in the timed rounds; round 0
    warms up (allocations, optimizer state) and counts towards the peak only."""
    out = {side: {"seconds": [], "peak_rss": 0, "rss_rise": 0, "padding_frac": None} for side in updates}
    pid = os.getpid()
    for round_ in range(args.repeats + 1):  # interleaved, so load on the machine hits both sides alike
        for side, update in updates.items():
            exact, start = reset_peak_rss(), rss_bytes(pid)
            s, padding = update()
            rec, peak = out[side], peak_rss_bytes(pid)
            rec["peak_rss"], rec["padding_frac"], rec["peak_rss_exact"] = max(rec["peak_rss"], peak), padding, exact
            if round_:
                rec["seconds"].append(s)
                rec["rss_rise"] = max(rec["rss_rise"], peak - start)
            print(f"learner bench: {side:6s} round {round_}{' (warm-up)' if not round_ else ''}: {s:.2f} s", flush=True)
    return out


def reset_peak_rss() -> bool:
    """Hand the heap's free pages back (glibc's malloc_trim: another side's freed activations
    would otherwise stay resident and hide this side's), then reset this process's peak-RSS
    mark (VmHWM) to its RSS now; False where the kernel refuses (the mark is then the
    process's peak so far)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def report_sides(args, record: dict, runs: dict) -> None:
    """Each side's median seconds, peak RSS and padding; its ratio to plain torch and (a packed
    side) to the padded tether side of its ZeRO stage."""
    for side, r in runs.items():
        record[side] = {**r, "median": statistics.median(r["seconds"])}
        padding = "" if r["padding_frac"] is None else f", perf/learner_padding_frac {r['padding_frac']:.3f}"
        mark = "" if r["peak_rss_exact"] else " (the process's peak so far: the kernel kept its mark)"
        print(f"learner bench: {side:24s} {record[side]['median']:7.2f} s per update (median of {len(r['seconds'])}), "
              f"peak RSS {r['peak_rss'] / 2**20:.0f} MiB{mark} (+{r['rss_rise'] / 2**20:.0f} over an update's start)"
              f"{padding}")
    for side in [s for s in runs if s != "torch"]:
        if "torch" in runs:
            record[f"ratio_{side}"] = ratio = record[side]["median"] / record["torch"]["median"]
            print(f"learner bench: {side} / plain torch = {ratio:.3f} (critic={args.critic}, {args.threads} threads)")
        padded = "tether-" + side.rsplit("-", 1)[1]
        if side.startswith("tether-packed") and padded in runs:
            record[f"ratio_{side}_padded"] = ratio = record[side]["median"] / record[padded]["median"]
            print(f"learner bench: {side} / {padded} = {ratio:.3f}")


def report_mfu(args, wl: dict, record: dict, params: int, device: torch.device) -> None:
    """The matmul peak of this device at this dtype, measured now (after the updates: clocks are
    up, and any TF32 switch a library flipped is in force), and each side's FLOP/s and MFU."""
    peak = matmul_peak(device, DTYPES[args.dtype][1] or torch.float32)
    flops = update_flops(params, args.rollouts, record["prompt_tokens"], record["response_tokens"], args.epochs)
    record.update(params=params, peak=peak, update_flops=flops)
    print(f"learner bench: {params / 1e6:.2f}M trainable parameters; measured matmul peak {device} {peak['dtype']}: "
          f"{peak['flops_per_s'] / 1e12:.4g} TFLOP/s ({peak['n']}^3 products, median of {peak['rounds']} x "
          f"{peak['per_round']}{', TF32 on' if peak['tf32'] else ''})")
    for side in [s for s in record if isinstance(record[s], dict) and "median" in record[s]]:
        record[side]["mfu"] = {count: f / record[side]["median"] / peak["flops_per_s"] for count, f in flops.items()}
        print(mfu_line(side, record[side]["median"], flops, peak["flops_per_s"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = use_device(args.device)
    torch.set_num_threads(args.threads)
    from bench.sizes import sized_workload
    from bench.workload import build_workload

    wl = sized_workload(json.loads(build_workload().read_text()), args.policy_size,
                        with_value=args.critic == "separate")
    batch = rollouts(wl, args.rollouts, args.new_tokens, args.ragged)
    record = {"critic": args.critic, "threads": args.threads, "rollouts": args.rollouts,
              "new_tokens": args.new_tokens, "ragged": args.ragged, "epochs": args.epochs,
              "minibatches": args.minibatches, "zero_stages": args.zero, "dtype": args.dtype, "device": args.device,
              "policy_size": args.policy_size,  # the mean tokens of a rollout (the FLOP counts take them)
              "prompt_tokens": float(np.mean([r.prompt_ids.size for r in batch])),
              "response_tokens": float(np.mean([r.response_ids.size for r in batch]))}
    if args.ragged:
        print(f"learner bench: ragged rollouts, {record['prompt_tokens']:.0f} prompt + {record['response_tokens']:.0f} "
              "response tokens on average")
    updates, params = build_sides(args, wl, batch, device)
    report_sides(args, record, run_rounds(args, updates))
    report_mfu(args, wl, record, params, device)
    write_record(args.out, record)
    return 0


def write_record(path: str, record: dict) -> None:
    """The run's figures as JSON at ``path`` (folders made)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())

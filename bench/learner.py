"""The learner's PPO update against a plain-torch loop doing the same work.

    .venv/bin/python -m bench.learner                       # the workload's 31.7M policy, critic=separate
    .venv/bin/python -m bench.learner --critic shared --threads 1 --zero 0 2
    .venv/bin/python -m bench.learner --rollouts 8 --new-tokens 8 --repeats 1    # smoke

Both sides, in this one process and with the same torch threads, train the same model
(learner.policy.PolicyWithValueHead on the workload's policy, plus the reward model's
copy as a separate critic) on the same batch of scored rollouts with the same minibatch
schedule: one no-grad forward for the old log-probs and values, then ppo_epochs x
minibatches of forward, clipped policy + value loss, backward and an AdamW step.

  - torch: the loop written out by hand with torch.optim.AdamW (fused, as tether builds it), no DeepSpeed;
  - tether: learner.worker.LearnerWorker (one rank, DeepSpeed ZeRO, as a run uses it).

Prints seconds per update (median of --repeats rounds after a warm-up round; the sides
take turns within each round), the ratio,
and writes runs/bench/learner.json. Figures mean something only on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def parse_args(argv):
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
    ap.add_argument("--sides", default="torch,tether")
    ap.add_argument("--out", default="runs/bench/learner.json")
    args = ap.parse_args(argv)
    if min(args.rollouts, args.new_tokens, args.epochs, args.minibatches, args.threads, args.repeats) < 1:
        ap.exit(2, "python -m bench.learner: error: every count must be >= 1\n")
    if args.rollouts % args.minibatches:
        ap.exit(2, f"python -m bench.learner: error: --rollouts {args.rollouts} must be a multiple of "
                   f"--minibatches {args.minibatches}\n")
    args.sides = [s for s in args.sides.split(",") if s]
    if not args.sides or set(args.sides) - {"torch", "tether"}:
        ap.exit(2, "python -m bench.learner: error: --sides takes a comma list of torch, tether\n")
    return args


def rollouts(wl: dict, n: int, new_tokens: int) -> list:
    """n scored rollouts of exactly new_tokens random response tokens after the workload's prompts."""
    from core.annotate import annotate
    from core.rollout import Rollout

    rng = np.random.default_rng(0)
    prompts = wl["prompt_ids"]
    out = [Rollout(prompt_ids=prompts[i % len(prompts)], response_ids=rng.integers(3, wl["vocab_size"], new_tokens),
                   behaviour_logprobs=-rng.uniform(5.5, 6.9, new_tokens), finish_reason="length",
                   policy_version=0, prompt_index=i, sample_index=0) for i in range(n)]
    refs = [r.behaviour_logprobs + rng.normal(0, 0.05, new_tokens).astype(np.float32) for r in out]
    return annotate(out, refs, rng.normal(size=n).astype(np.float32), beta=0.05, kl_estimator="k1")


def config(args, wl: dict, zero_stage: int) -> dict:
    """The learner config of bench-30m.yaml (TRL's PPO settings) at this batch size."""
    mb = args.rollouts // args.minibatches
    return {"zero_stage": zero_stage, "critic": args.critic,
            "critic_model": wl["value"] if args.critic == "separate" else None,
            "optim": {"lr": 1e-5, "betas": [0.9, 0.999], "warmup_steps": 0, "decay": "constant", "grad_clip": 0.0},
            "ppo": {"ppo_epochs": args.epochs, "minibatch_size": mb, "micro_batch_size": mb, "clip_low": 0.2,
                    "value_clip": 0.2, "vf_coef": 0.1, "entropy_coef": 0.0, "gamma": 1.0, "lam": 0.95}}


def torch_side(args, wl: dict, batch_rollouts: list):
    """The same update as a hand-written loop: AdamW, no DeepSpeed, no stats, no collectives.
    Returns a callable doing one update and returning its seconds."""
    from core import ppo
    from core.advantages import gae
    from core.masked import whiten
    from learner.batch import collate
    from learner.policy import PolicyWithValueHead

    model = PolicyWithValueHead.from_pretrained(wl["policy"], critic=args.critic,
                                                critic_model=wl["value"] if args.critic == "separate" else None)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, fused=True)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
    mb = args.rollouts // args.minibatches

    def update() -> float:
        t0 = time.perf_counter()
        b = collate(batch_rollouts, pad)
        m = b.response_mask
        with torch.no_grad():
            old_lp, old_v, _ = model.response_logprobs_values(b, with_entropy=False)
            old_lp, old_v = old_lp * m, old_v * m
            adv, ret = gae(b.rewards, old_v, m, 1.0, 0.95)
            adv = whiten(adv.double(), m).float()
        n_tok = float(m.sum()) / args.minibatches
        for epoch in range(args.epochs):
            order = np.random.default_rng([0, epoch]).permutation(len(b))
            for k in range(args.minibatches):
                rows = torch.as_tensor(order[k * mb:(k + 1) * mb])
                mic = b[rows].trimmed()
                lp, v, _ = model.response_logprobs_values(mic, with_entropy=True)
                mm = mic.response_mask
                R = mm.shape[1]
                kw = dict(agg="token-mean", global_tokens=n_tok, global_seqs=float(mb), horizon=R)
                pg, _, _ = ppo.policy_loss(lp, old_lp[rows][:, :R], adv[rows][:, :R], mm, 0.2, 0.2, None, **kw)
                vf, _ = ppo.value_loss(v, old_v[rows][:, :R], ret[rows][:, :R], mm, 0.2, **kw)
                (pg + 0.1 * vf).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return update


def tether_side(args, wl: dict, batch_rollouts: list, zero_stage: int):
    from learner.worker import LearnerWorker

    worker = LearnerWorker(rank=0, world_size=1, model=wl["policy"], config=config(args, wl, zero_stage))
    return lambda: worker.train(batch_rollouts)["perf/learner_seconds"]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    from bench.workload import build_workload

    wl = json.loads(build_workload().read_text())
    batch = rollouts(wl, args.rollouts, args.new_tokens)
    record = {"critic": args.critic, "threads": args.threads, "rollouts": args.rollouts,
              "new_tokens": args.new_tokens, "epochs": args.epochs, "minibatches": args.minibatches,
              "zero_stages": args.zero}
    updates = {}
    for side in args.sides:
        if side == "torch":
            updates["torch"] = torch_side(args, wl, batch)
        for stage in (args.zero if side == "tether" else []):
            updates[f"tether-z{stage}"] = tether_side(args, wl, batch, stage)
    seconds = {side: [] for side in updates}
    for round_ in range(args.repeats + 1):  # interleaved, so load on the machine hits both sides alike
        for side, update in updates.items():
            s = update()
            if round_:  # round 0 warms up (allocations, optimizer state)
                seconds[side].append(s)
            print(f"learner bench: {side:6s} round {round_}{' (warm-up)' if not round_ else ''}: {s:.2f} s", flush=True)
    for side, s in seconds.items():
        record[side] = {"seconds": s, "median": statistics.median(s)}
        print(f"learner bench: {side:6s} {statistics.median(s):7.2f} s per update (median of {len(s)})")
    for side in [s for s in seconds if s != "torch" and "torch" in seconds]:
        record[f"ratio_{side}"] = ratio = record[side]["median"] / record["torch"]["median"]
        print(f"learner bench: {side} / plain torch = {ratio:.3f} (critic={args.critic}, {args.threads} threads)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

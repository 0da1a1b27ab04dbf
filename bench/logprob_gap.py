"""How far the learner's bf16 log-probs land from its fp32 ones: same policy, same batch.

    python -m bench.logprob_gap --device cuda --policy-size large

The policy is scored through learner.policy's own path (``response_logprobs_values``) in
fp32, then cast to bf16 the way DeepSpeed's bf16 mode casts the module (bf16 weights and
activations) and scored again. That path upcasts the bf16 logits to fp32 before the
log-softmax (core.logprobs), so the gap is what bf16 weights and activations cost. For
contrast, the same bf16 logits through a log-softmax kept in bf16: a log-prob near
-log(V) ~ -12 has a bf16 spacing of 1/16 nat, so that gap is far larger. Prints the
gaps over the response tokens and writes them to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch


def parse_args(argv):
    from bench.sizes import SIZES

    ap = argparse.ArgumentParser(prog="python -m bench.logprob_gap", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--policy-size", choices=tuple(SIZES), default="bench")
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/bench/logprob_gap.json")
    args = ap.parse_args(argv)
    if min(args.rollouts, args.new_tokens) < 1:
        ap.exit(2, "python -m bench.logprob_gap: error: every count must be >= 1\n")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.exit(2, "python -m bench.logprob_gap: error: --device cuda, but torch sees no CUDA device\n")
    return args


def gap_stats(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict:
    """Max and mean |lp - ref| over the masked positions, in nats (float64 arithmetic)."""
    d = (lp.double() - ref.double())[mask.bool()].abs()
    return {"max": float(d.max()), "mean": float(d.mean())}


def scores(model, batch) -> dict:
    """The policy's response log-probs through learner.policy's path, and (for the contrast) a
    log-softmax done in the logits' own dtype."""
    from learner.batch import response_slice

    with torch.no_grad():
        lp, _, _ = model.response_logprobs_values(batch, with_entropy=False)
        logits, _ = model(batch.input_ids, batch.attention_mask, batch.position_ids)
        logits = response_slice(logits, batch.prompt_len, batch.response_len)
        same_dtype = torch.log_softmax(logits, dim=-1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    return {"path": lp, "same_dtype": same_dtype, "logits_dtype": str(logits.dtype).removeprefix("torch.")}


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench.learner import rollouts, use_device
    from bench.sizes import sized_workload
    from bench.workload import build_workload
    from core.modeling.loading import pad_token_id
    from learner.batch import collate
    from learner.policy import PolicyWithValueHead

    device = use_device(args.device)
    wl = sized_workload(json.loads(build_workload().read_text()), args.policy_size, with_value=False)
    model = PolicyWithValueHead.from_pretrained(wl["policy"], critic="shared").to(device).eval()
    batch = collate(rollouts(wl, args.rollouts, args.new_tokens), pad_token_id(None, model.config, "bench")).to(device)
    fp32 = scores(model, batch)
    bf16 = scores(model.to(torch.bfloat16), batch)  # what deepspeed's bf16 does to the module
    mask = batch.response_mask
    record = {"device": args.device, "policy_size": args.policy_size, "vocab_size": wl["vocab_size"],
              "tokens": int(mask.sum()), "bf16_path_dtype": str(bf16["path"].dtype).removeprefix("torch."),
              "bf16_logits_dtype": bf16["logits_dtype"],
              "mean_fp32_logprob": float(fp32["path"][mask.bool()].mean()),
              "gap_bf16_upcast": gap_stats(bf16["path"], fp32["path"], mask),
              "gap_bf16_logsoftmax_in_bf16": gap_stats(bf16["same_dtype"], fp32["path"], mask),
              "fp32_paths_agree": gap_stats(fp32["same_dtype"], fp32["path"], mask)}
    for line in report(record):
        print(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return 0


def report(r: dict) -> list[str]:
    g, n, a = r["gap_bf16_upcast"], r["gap_bf16_logsoftmax_in_bf16"], r["fp32_paths_agree"]
    return [f"logprob gap: {r['policy_size']} policy on {r['device']}, {r['tokens']} response tokens, vocabulary "
            f"{r['vocab_size']}, mean fp32 log-prob {r['mean_fp32_logprob']:.3f}",
            f"logprob gap: bf16 module, learner.policy's path (logits {r['bf16_logits_dtype']} upcast, log-probs "
            f"{r['bf16_path_dtype']}): max {g['max']:.3g}, mean {g['mean']:.3g} nats from fp32",
            f"logprob gap: bf16 module, log-softmax left in bf16: max {n['max']:.3g}, mean {n['mean']:.3g} nats "
            f"(fp32 through both paths: max {a['max']:.3g})"]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())

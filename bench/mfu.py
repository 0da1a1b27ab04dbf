"""The GPU check's report (scripts/gpu-check.sh): a finished run's learner MFU, generation
throughput and weight-sync time, from its metrics.jsonl.

    .venv/bin/python -m bench.mfu runs/gpu-check-20270101-120000 --gpu "NVIDIA H100 80GB HBM3" --gpus 1

MFU = 6 x trainable parameters x learner tokens/s / the GPU's peak dense bf16 FLOP/s (6 N
FLOPs per token: 2 N forward, 4 N backward). The learner's tokens/s is
``perf/learner_tokens_per_s``: the response tokens of one update per second of it; the
update's epochs, its no-grad forward and the prompt tokens are work not counted, so the figure
is a floor. Each figure is the median over the steps after the first ``--warmup``.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

# Peak dense (no sparsity) bf16 tensor FLOP/s by the name nvidia-smi prints, from the vendor's
# data sheets; first match wins. A GPU not listed gets "MFU n/a" rather than a guess.
PEAK_BF16_DENSE = (
    (("H100", "SXM"), 989e12), (("H100", "HBM3"), 989e12),  # nvidia-smi: "NVIDIA H100 80GB HBM3" (SXM5)
    (("H200",), 989e12),
    (("A100",), 312e12),
    (("L40S",), 362e12),
)
NOT_LISTED = ("NVL", "PCIe", "PCIE")  # other clocks and peaks than the SXM part of the same name

METRICS = {"learner_tokens_per_s": "perf/learner_tokens_per_s", "tokens_per_s": "perf/tokens_per_s",
           "sync_seconds": "perf/sync_seconds", "sync_bytes": "perf/sync_bytes"}


def peak_flops(gpu_name: str) -> tuple[Optional[float], str]:
    """(peak dense bf16 FLOP/s, "") for a listed GPU, else (None, why not)."""
    if not any(word in gpu_name for word in NOT_LISTED):
        for words, peak in PEAK_BF16_DENSE:
            if all(w in gpu_name for w in words):
                return peak, ""
    return None, f"no peak bf16 FLOP/s listed for {gpu_name!r} (bench/mfu.py PEAK_BF16_DENSE)"


def mfu(params: int, tokens_per_s: float, peak: float) -> float:
    """Model FLOPs utilisation: 6 N FLOPs per trained token over the peak."""
    return 6.0 * params * tokens_per_s / peak


def count_params(model_dir: Path) -> int:
    """Elements in every safetensors file of a saved policy (the LM and its value head)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= int(d)
                total += n
    if not total:
        raise ValueError(f"bench.mfu: no safetensors weights in {model_dir}; did the run finish?")
    return total


def summarize(rows: list[dict], warmup: int) -> dict:
    """Median of each METRICS figure over the training steps after the first ``warmup``."""
    steps = [r for r in rows if r.get("step", 0) >= 1 and METRICS["learner_tokens_per_s"] in r]
    if not steps:
        raise ValueError("bench.mfu: metrics.jsonl has no training step; did the run train?")
    kept = steps[warmup:] if len(steps) > warmup else steps
    out = {key: statistics.median(float(r[name]) for r in kept if name in r) for key, name in METRICS.items()}
    out["steps"] = (kept[0]["step"], kept[-1]["step"])
    return out


def report(figures: dict, *, params: int, gpu_name: str, gpus: int, weight_sync: str) -> list[str]:
    peak, why = peak_flops(gpu_name)
    first, last = figures["steps"]
    learner = figures["learner_tokens_per_s"]
    util = (f"MFU {100 * mfu(params, learner, peak):.3g}% (6 x {params / 1e6:.2f}M params x tokens/s / "
            f"{peak / 1e12:.0f} TFLOP/s dense bf16)" if peak else f"MFU n/a: {why}")
    return [f"gpu-check: {gpu_name} x{gpus}, weight_sync={weight_sync}, medians over steps {first}-{last}",
            f"  learner:     {learner:,.0f} tokens/s, {util}",
            f"  generation:  {figures['tokens_per_s']:,.0f} tokens/s",
            f"  weight sync: {figures['sync_seconds']:.4f} s per push ({figures['sync_bytes'] / 1e6:.2f} MB)"]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mfu", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished run folder (metrics.jsonl, checkpoints/final)")
    parser.add_argument("--gpu", required=True, help="the GPU's name as nvidia-smi prints it")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs on the machine")
    parser.add_argument("--warmup", type=int, default=5, help="first training steps left out")
    args = parser.parse_args(argv)
    import yaml

    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    config = yaml.safe_load((args.run_dir / "config.yaml").read_text())
    lines = report(summarize(rows, args.warmup), params=count_params(args.run_dir / "checkpoints" / "final"),
                   gpu_name=args.gpu, gpus=args.gpus, weight_sync=config["learner"]["weight_sync"])
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

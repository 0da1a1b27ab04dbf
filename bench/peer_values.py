"""verl's values for tether's rollout corrections and policy losses, on fixed seeded tensors.

Runs in a throwaway virtualenv where verl is installed, and imports nothing of tether:

    python -m venv /tmp/peer-venv
    /tmp/peer-venv/bin/pip install torch==2.13.0 ray "tensordict>=0.8,<=0.10" "transformers>=5.5.3,<5.11" \\
        packaging omegaconf codetiming
    /tmp/peer-venv/bin/pip install --no-deps verl==0.9.1
    /tmp/peer-venv/bin/python bench/peer_values.py --out tests/core/peer_values.json

It writes the inputs (float64 [B, T] log-probs, advantages and a mask with padding and a
multi-turn row's masked context, garbage at the masked places) and, for each preset of
``ppo.off_policy`` with a verl counterpart, the per-token factor verl's
compute_rollout_correction_and_rejection_mask gives the policy loss (its IS weight times its
modified response mask), with the parameters of verl's RolloutCorrectionConfig presets; and
the loss, gradient and clip fraction of verl's compute_policy_loss_gspo and
compute_policy_loss_cispo. tests/core/test_peer_values.py recomputes them with tether's.
"""
from __future__ import annotations

import argparse
import json

import torch

B, T = 8, 12
D = torch.float64


def inputs() -> dict:
    """Seeded [B, T] tensors: rows 0-3 nearly on-policy (log-ratios ~1e-4, inside Geo-RS's
    +-0.1% band and GSPO's clip range), rows 4-7 off-policy (~0.3); row 5 is multi-turn."""
    g = torch.Generator().manual_seed(20250)
    behaviour = -torch.rand(B, T, generator=g, dtype=D) * 3 - 0.1
    scale = torch.tensor([1e-4, 2e-4, 5e-4, 3e-3, 0.2, 0.3, 0.4, 0.6], dtype=D)[:, None]
    proximal = behaviour + torch.randn(B, T, generator=g, dtype=D) * scale
    logprobs = proximal + torch.randn(B, T, generator=g, dtype=D) * scale
    advantages = torch.randn(B, 1, generator=g, dtype=D).expand(B, T) + 0.1 * torch.randn(B, T, generator=g, dtype=D)
    lengths = torch.tensor([12, 9, 5, 12, 7, 12, 3, 10])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(D)
    mask[5, 3:6] = 0  # a multi-turn row: the context between two turns
    garbage = torch.randn(B, T, generator=g, dtype=D) * 5
    fill = lambda x: torch.where(mask != 0, x, garbage)  # noqa: E731 - what must never be read
    return {"proximal": fill(proximal), "behaviour": fill(behaviour), "logprobs": fill(logprobs),
            "advantages": fill(advantages.contiguous()), "mask": mask}


def corrections(x: dict) -> dict:
    """Per preset: the factor verl's rollout correction puts on each token's policy loss."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig as C
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    presets = {"tis": C.decoupled_token_is(), "seq_tis": C.decoupled_seq_is(), "seq_mis": C.decoupled_seq_is_rs(),
               "geo_rs": C.decoupled_geo_rs(), "geo_rs_token_tis": C.decoupled_geo_rs_token_tis(),
               "icepop": C.decoupled_token_icepop()}
    out = {}
    for name, cfg in presets.items():
        weights, new_mask, _ = compute_rollout_correction_and_rejection_mask(
            x["proximal"], x["behaviour"], x["mask"], rollout_is=cfg.rollout_is,
            rollout_is_threshold=cfg.rollout_is_threshold, rollout_rs=cfg.rollout_rs,
            rollout_rs_threshold=cfg.rollout_rs_threshold)
        w = weights.batch["rollout_is_weights"] if weights is not None else torch.ones_like(new_mask)
        out[name] = {"preset": f"RolloutCorrectionConfig.{preset_method(name)}()",
                     "is_threshold": cfg.rollout_is_threshold if cfg.rollout_is else None,
                     "rs": cfg.rollout_rs, "rs_threshold": cfg.rollout_rs_threshold,
                     "factor": (w * new_mask).tolist()}
    return out


def preset_method(name: str) -> str:
    return {"tis": "decoupled_token_is", "seq_tis": "decoupled_seq_is", "seq_mis": "decoupled_seq_is_rs",
            "geo_rs": "decoupled_geo_rs", "geo_rs_token_tis": "decoupled_geo_rs_token_tis",
            "icepop": "decoupled_token_icepop"}[name]


def losses(x: dict, seq_weights: torch.Tensor) -> dict:
    """verl's GSPO (seq-mean-token-mean, clip 3e-4/4e-4) and CISPO (token-mean, clip 0.2/0.28),
    with and without rollout-correction weights: loss, d loss / d logprobs, clip fraction."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_cispo, compute_policy_loss_gspo
    from verl.workers.config.actor import ActorConfig

    cases = {"gspo": (compute_policy_loss_gspo, "seq-mean-token-mean", 3e-4, 4e-4),
             "cispo": (compute_policy_loss_cispo, "token-mean", 0.2, 0.28)}
    out = {}
    for name, (fn, agg, low, high) in cases.items():
        cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=low,
                          clip_ratio_low=low, clip_ratio_high=high)
        for weighted in (False, True):
            lp = x["logprobs"].clone().requires_grad_(True)
            loss, metrics = fn(x["proximal"], lp, x["advantages"], x["mask"], loss_agg_mode=agg, config=cfg,
                               rollout_is_weights=seq_weights if weighted else None)
            loss.backward()
            out[f"{name}{'_weighted' if weighted else ''}"] = {
                "function": fn.__name__, "agg": agg, "clip_low": low, "clip_high": high, "loss": loss.item(),
                "grad": lp.grad.tolist(), "clip_frac": metrics["actor/pg_clipfrac"]}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="peer_values.py")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import verl

    x = inputs()
    fixed = corrections(x)
    seq_weights = torch.tensor(fixed["seq_tis"]["factor"], dtype=D)
    result = {"peer": f"verl {verl.__version__}", "torch": torch.__version__,
              "inputs": {k: v.tolist() for k, v in x.items()}, "corrections": fixed,
              "losses": losses(x, seq_weights)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

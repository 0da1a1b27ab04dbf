"""tether's rollout corrections and policy losses against verl's own code, to 1e-6.

tests/core/peer_values.json was written by bench/peer_values.py in a virtualenv holding verl 0.9.1
(PyPI) and torch 2.13.0 (its "peer" and "torch" fields): seeded float64 [8, 12] inputs (padding, a
multi-turn row's masked context, garbage at every masked place) and verl's outputs for them:

- per preset, the factor on each token's policy loss from
  verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask with the
  parameters of verl's RolloutCorrectionConfig presets (decoupled_token_is, decoupled_seq_is,
  decoupled_seq_is_rs, decoupled_geo_rs, decoupled_geo_rs_token_tis, decoupled_token_icepop):
  its IS weight times its modified response mask;
- the loss, gradient and clip fraction of verl.trainer.ppo.core_algos.compute_policy_loss_gspo
  (seq-mean-token-mean, clip 3e-4/4e-4) and compute_policy_loss_cispo (token-mean, clip 0.2/0.28),
  without and with seq_tis's weights.

Here tether's core.corrections.correct and core.policy_losses recompute them on the same inputs.
"""
import json
from pathlib import Path

import pytest
import torch

from core.choices import correction_row
from core.corrections import Bounds, correct
from core.policy_losses import cispo_loss, gspo_loss
from core.ppo import Aggregation

pytestmark = pytest.mark.unit

FIXTURE = json.loads((Path(__file__).parent / "peer_values.json").read_text())
D = torch.float64
TOL = dict(rtol=0.0, atol=1e-6)


def tensor(name):
    return torch.tensor(FIXTURE["inputs"][name], dtype=D)


def test_the_fixture_is_verls_and_the_table_names_its_presets():
    assert FIXTURE["peer"] == "verl 0.9.1"
    assert set(FIXTURE["corrections"]) == {"tis", "seq_tis", "seq_mis", "geo_rs", "geo_rs_token_tis", "icepop"}
    for preset, peer in FIXTURE["corrections"].items():  # "RolloutCorrectionConfig.decoupled_seq_is_rs()"
        assert f"verl {peer['preset'].split('.')[1][:-2]}" in correction_row(preset).peer


@pytest.mark.parametrize("preset", sorted(FIXTURE["corrections"]))
def test_each_preset_matches_verls_rollout_correction(preset):
    peer = FIXTURE["corrections"][preset]
    lower, upper = correction_row(preset).band or (0.5, 2.0)  # tether's defaults: verl's presets'
    out = correct(tensor("proximal"), tensor("behaviour"), tensor("mask"), preset,
                  Bounds(cap=2.0, lower=lower, upper=upper))
    factor = torch.tensor(peer["factor"], dtype=D)
    torch.testing.assert_close(out.weights, factor, **TOL)
    # the preset rejected something on these inputs, or truncated something: the test can fail
    assert (factor == 0).sum() > (tensor("mask") == 0).sum() or (factor == 2.0).any() or preset == "seq_tis"


@pytest.mark.parametrize("case", sorted(FIXTURE["losses"]))
def test_gspo_and_cispo_match_verls(case):
    peer = FIXTURE["losses"][case]
    fn = {"compute_policy_loss_gspo": gspo_loss, "compute_policy_loss_cispo": cispo_loss}[peer["function"]]
    weights = torch.tensor(FIXTURE["corrections"]["seq_tis"]["factor"], dtype=D) if case.endswith("weighted") else None
    lp = tensor("logprobs").requires_grad_(True)
    loss, clip_frac, _ = fn(lp, tensor("proximal"), tensor("advantages"), tensor("mask"), peer["clip_low"],
                            peer["clip_high"], Aggregation(mode=peer["agg"]), weights=weights)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(peer["loss"], dtype=D), **TOL)
    torch.testing.assert_close(lp.grad, torch.tensor(peer["grad"], dtype=D), **TOL)
    torch.testing.assert_close(clip_frac, torch.tensor(peer["clip_frac"], dtype=D), **TOL)
    assert 0 < peer["clip_frac"] < 1  # some tokens clipped, some not: the clip is exercised

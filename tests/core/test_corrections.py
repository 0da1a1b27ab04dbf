"""Unit tests for the rollout corrections (core/corrections.py, ``ppo.off_policy``): each preset's
weights and its truncated and masked tokens computed by hand on three rows, one of them a
multi-turn row whose masked context must not count; the table and the functions agree."""
import math

import pytest
import torch

from core import corrections, ppo
from core.choices import CORRECTION_TABLE, OFF_POLICY_MODES, band_error, correction_row
from core.corrections import Bounds, correct

pytestmark = pytest.mark.unit

D = torch.float64
F, T_ = False, True
# w = pi_prox / pi_behaviour per token. Row 0: 0.4, 1, 3 and padding; row 1 (multi-turn): 2.5, a
# masked context position (its garbage ratio e^7 must not count), 1.5, 0.8; row 2: about 1.
#   W (product):        row 0: 1.2   row 1: 3.0         row 2: 1.0005 * 0.9995 = 0.99999975
#   G (geometric mean): row 0: 1.2^(1/3) = 1.0627   row 1: 3^(1/3) = 1.4422   row 2: ~1
RATIOS = [[0.4, 1.0, 3.0, 1.0], [2.5, math.exp(7.0), 1.5, 0.8], [1.0005, 0.9995, 1.0, 1.0]]
MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
W2 = 1.0005 * 0.9995
R2 = [1.0005, 0.9995, 1.0, 0.0]
NOTHING = [[F] * 4] * 3

# preset -> (bounds, weights, truncated, masked), with cap 2 and the presets' default bands.
EXPECTED = {
    "none": (None, [[1, 1, 1, 0], [1, 0, 1, 1], [1, 1, 1, 0]], NOTHING, NOTHING),
    "tis": (None, [[0.4, 1, 2, 0], [2, 0, 1.5, 0.8], R2],
            [[F, F, T_, F], [T_, F, F, F], [F] * 4], NOTHING),
    "decoupled": (None, [[0.4, 1, 0, 0], [0, 0, 1.5, 0.8], R2],
                  NOTHING, [[F, F, T_, F], [T_, F, F, F], [F] * 4]),
    # W = 1.2 on row 0; row 1's 3.0 truncated to the cap on its three tokens, not its context.
    "seq_tis": (None, [[1.2, 1.2, 1.2, 0], [2, 0, 2, 2], [W2, W2, W2, 0]],
                [[F] * 4, [T_, F, T_, T_], [F] * 4], NOTHING),
    # band [0.5, 2]: row 1's W = 3 is outside it, the whole row rejected.
    "seq_mis": (None, [[1.2, 1.2, 1.2, 0], [0] * 4, [W2, W2, W2, 0]], NOTHING, [[F] * 4, [T_, F, T_, T_], [F] * 4]),
    # band [0.999, 1.001]: only row 2's G is inside.
    "geo_rs": (None, [[0] * 4, [0] * 4, [1, 1, 1, 0]], NOTHING, [[T_, T_, T_, F], [T_, F, T_, T_], [F] * 4]),
    "geo_rs_token_tis": (None, [[0] * 4, [0] * 4, R2], NOTHING, [[T_, T_, T_, F], [T_, F, T_, T_], [F] * 4]),
    # band [0.5, 5]: token 0.4 is masked, nothing truncated (3.0 and 2.5 stay).
    "icepop": (None, [[0, 1, 3, 0], [2.5, 0, 1.5, 0.8], R2], NOTHING, [[T_, F, F, F], [F] * 4, [F] * 4]),
}


def inputs(ratios=RATIOS, mask=MASK):
    """(proximal, behaviour, mask) [3, 4] float64 with pi_prox / pi_behaviour = ``ratios``."""
    behaviour = torch.full((3, 4), -1.3, dtype=D)
    return behaviour + torch.log(torch.tensor(ratios, dtype=D)), behaviour, torch.tensor(mask, dtype=D)


def bounds_of(preset, cap=2.0, band=None):
    lower, upper = band or correction_row(preset).band or (0.5, 2.0)
    return Bounds(cap=cap, lower=lower, upper=upper)


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_each_preset_by_hand(preset):
    band, weights, truncated, masked = EXPECTED[preset]
    out = correct(*inputs(), preset, bounds_of(preset, band=band))
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=D))
    assert out.truncated.tolist() == truncated
    assert out.masked.tolist() == masked
    assert not out.weights.requires_grad


def test_every_row_of_the_table_has_a_function_and_a_hand_computation():
    assert set(corrections.PRESETS) == set(OFF_POLICY_MODES) == set(EXPECTED)
    assert OFF_POLICY_MODES[:3] == ("none", "tis", "decoupled")  # the names a config already holds


def test_a_looser_band_keeps_a_row_and_a_cap_truncates_within_it():
    # geo band [0.8, 1.2] keeps row 0 (G = 1.0627) and rejects row 1 (G = 1.44).
    out = correct(*inputs(), "geo_rs_token_tis", bounds_of("geo_rs_token_tis", band=(0.8, 1.2)))
    torch.testing.assert_close(out.weights, torch.tensor([[0.4, 1, 2, 0], [0] * 4, R2], dtype=D))
    assert out.truncated.tolist() == [[F, F, T_, F], [F] * 4, [F] * 4]
    # seq_mis with a band past W = 3 keeps row 1 at its truncated weight.
    out = correct(*inputs(), "seq_mis", bounds_of("seq_mis", band=(0.5, 4.0)))
    torch.testing.assert_close(out.weights[1], torch.tensor([2, 0, 2, 2], dtype=D))
    assert out.truncated[1].tolist() == [T_, F, T_, T_] and not out.masked.any()


@pytest.mark.parametrize("preset", OFF_POLICY_MODES)
def test_the_masked_context_and_the_padding_do_not_count(preset):
    base = correct(*inputs(), preset, bounds_of(preset))
    garbage = [row[:] for row in RATIOS]
    garbage[1][1], garbage[0][3] = 1e-30, 1e30
    other = correct(*inputs(garbage), preset, bounds_of(preset))
    assert torch.equal(base.weights, other.weights) and torch.equal(base.masked, other.masked)
    assert torch.equal(base.truncated, other.truncated)


def test_a_token_outside_the_proximal_set_zeroes_or_rejects_its_row():
    prox, behav, mask = inputs()
    prox[2, 1] = float("-inf")  # truncated sampling: pi_prox would never sample it
    for preset, row in (("seq_tis", [0.0, 0.0, 0.0, 0.0]), ("seq_mis", [0.0] * 4), ("geo_rs", [0.0] * 4)):
        out = correct(prox, behav, mask, preset, bounds_of(preset))
        assert out.weights[2].tolist() == row
        assert torch.isfinite(out.weights).all()
    out = correct(prox, behav, mask, "icepop", bounds_of("icepop"))
    assert out.weights[2, 1] == 0 and out.masked[2].tolist() == [F, T_, F, F]


def test_extreme_ratios_stay_finite():
    prox, behav, mask = inputs([[1e30, 1e-30, 1.0, 1.0]] * 3)
    for preset in OFF_POLICY_MODES:
        assert torch.isfinite(correct(prox, behav, mask, preset, bounds_of(preset)).weights).all(), preset


def test_behaviour_weights_keeps_its_api_and_takes_the_presets():
    prox, behav, mask = inputs()
    w, capped = ppo.behaviour_weights(prox, behav, mask, "seq_mis", 2.0)
    torch.testing.assert_close(w, torch.tensor(EXPECTED["seq_mis"][1], dtype=D))
    assert capped.tolist() == EXPECTED["seq_mis"][3]  # truncated or masked
    w, _ = ppo.behaviour_weights(prox, behav, mask, "seq_mis", 2.0, band=(0.5, 4.0))
    assert w[1, 0] == 2.0


def test_bad_presets_and_bands_are_one_line_naming_the_key():
    with pytest.raises(ValueError, match="ppo.off_policy='is_seq' is unknown; use one of none, tis, decoupled, "
                                         "seq_tis, seq_mis, geo_rs, geo_rs_token_tis, icepop"):
        correction_row("is_seq")
    with pytest.raises(ValueError, match="need 0 < lower < upper"):
        correct(*inputs(), "icepop", Bounds(lower=2.0, upper=1.0))
    assert band_error("icepop", None, None) is None
    assert band_error("icepop", 0.0, None) == "ppo.rs_lower=0.0 and ppo.rs_upper=5.0 make no band: need 0 < " \
                                               "rs_lower < rs_upper"
    assert band_error("seq_mis", 2.0, 2.0).startswith("ppo.rs_lower=2.0 and ppo.rs_upper=2.0 make no band")
    assert "masks nothing by a band" in band_error("tis", 0.5, None)
    assert all(row.band is None or 0 < row.band[0] < 1 < row.band[1] for row in CORRECTION_TABLE)

"""Every model family through the learner's packed forward (learner/packing.py): one row of
sequences with restarting position ids and no attention mask must give what the padded batch
gives, and no sequence may see another, with the family's own attention (eager for Gemma-2's
soft-capping, sliding windows shorter than the sequences) in the policy and in a separate
critic body of the same family; then the same on varlen attention (core/modeling/varlen_attention.py),
which every family but Gemma-2 (soft-capping: it keeps eager attention) takes."""
import dataclasses

import numpy as np
import pytest
import torch
from reward_configs import reward_config

from cluster.demo.families import FAMILIES, build_family_policy, build_family_reward
from core.modeling.varlen_attention import VARLEN
from core.rollout import Rollout
from learner.batch import collate
from learner.packing import pack
from learner.policy import PolicyWithValueHead

KEEP_THEIR_ATTENTION = {"gemma2": "eager"}  # attention logit soft-capping


def ragged(pad_id, vocab=900, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [(2, 25), (14, 1), (5, 17), (9, 4), (3, 30)]  # (prompt, response): most past the window of 8
    return collate([Rollout(prompt_ids=rng.integers(3, vocab, p), response_ids=rng.integers(3, vocab, r),
                            behaviour_logprobs=np.zeros(r, np.float32), finish_reason="stop", policy_version=0,
                            prompt_index=i, sample_index=0) for i, (p, r) in enumerate(lengths)], pad_id)


def packed_outputs(model, b):
    """(outputs of the packed batch, outputs with sequence 0's tokens changed)."""
    changed = b.input_ids.clone()
    changed[0, b.attention_mask[0].bool()] = torch.randint(3, 900, (int(b.attention_mask[0].sum()),))
    p, q = pack(b), pack(dataclasses.replace(b, input_ids=changed))
    with torch.no_grad():
        return model(p.input_ids, None, p.position_ids, packed=p), model(q.input_ids, None, q.position_ids, packed=q)


@pytest.mark.integration
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_packed_forward_gives_the_padded_outputs_and_sequences_stay_apart(family):
    model = PolicyWithValueHead.from_pretrained(build_family_policy(family), critic="separate",
                                                critic_model=str(build_family_reward(family))).eval()
    b = ragged(model.config.pad_token_id)
    m = b.response_mask != 0
    with torch.no_grad():
        padded = model(b.input_ids, b.attention_mask, b.position_ids, prompt_len=b.prompt_len)
    for attention in ("own", "varlen"):
        if attention == "varlen":
            expected = KEEP_THEIR_ATTENTION.get(family, VARLEN)
            assert model.use_varlen() == {"lm": expected, "critic": expected}
            assert model.lm.config._attn_implementation == expected  # a family that keeps its own: as loaded
        packed, other = packed_outputs(model, b)
        gaps = [float((x - y)[m].abs().max()) for x, y in zip(padded, packed)]
        print(f"{family} ({model.lm.config._attn_implementation}): packed vs padded log-prob, value, entropy "
              f"gaps {', '.join(f'{g:.1e}' for g in gaps)}")
        assert max(gaps) < 1e-5 and float(packed[1][m].abs().max()) > 1e-3  # the critic's values, not zeros
        assert not torch.equal(packed[0][0], other[0][0])
        assert all(torch.equal(x[1:], y[1:]) for x, y in zip(packed, other))  # the other sequences: to the bit
    with torch.no_grad():  # the padded forward of a model on varlen attention: as before, to the bit
        again = model(b.input_ids, b.attention_mask, b.position_ids, prompt_len=b.prompt_len)
    assert all(torch.equal(x, y) for x, y in zip(padded, again))


@pytest.mark.integration
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_scorers_packed_give_their_padded_scores(family):
    """The reference's log-probs and the reward model's scores, packed (the default) and padded,
    on ragged sequences most of which pass a sliding window of 8."""
    from actors.reference import Reference
    from actors.reward import Reward

    rng = np.random.default_rng(1)
    lengths = [(2, 25), (14, 1), (5, 17), (9, 4), (3, 30)]
    prompts = [rng.integers(3, 900, p) for p, _ in lengths]
    responses = [rng.integers(3, 900, r) for _, r in lengths]
    policy, reward = str(build_family_policy(family)), str(build_family_reward(family))
    ref = [Reference(model=policy, device="cpu", packing=p).logprobs(prompts, responses) for p in (True, False)]
    gap = max(float(np.abs(a - b).max()) for a, b in zip(*ref))
    scores = [Reward(config=reward_config(model=reward, packing=p), device="cpu").score(prompts, responses).scores
              for p in (True, False)]
    print(f"{family}: reference packed vs padded {gap:.1e}, reward {float(np.abs(scores[0] - scores[1]).max()):.1e}")
    assert gap < 1e-5 and np.allclose(scores[0], scores[1], atol=1e-5, rtol=0)
    assert len(set(np.round(scores[0], 4))) == len(lengths)  # scores that depend on the sequence

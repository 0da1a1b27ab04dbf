"""A separate critic inside the learner, on real DeepSpeed (CPU, gloo): the update trains the policy,
the critic body and its value head to the same weights as a plain single-process update written
out on Hugging Face's own models (an AutoModelForCausalLM, and the reward model's
AutoModelForSequenceClassification body with its score head as the value head), so whatever the
learner does to run the critic fast (its layout, its forwards, where its values are read) is
checked against the definition: V(s_t) is the critic's head on its body's hidden state at the
position before response token t."""
import dataclasses

import pytest
import torch
from helpers import make_rollouts, max_abs_diff, sgd_config

from core import ppo
from core.advantages import gae
from core.logprobs import logprobs_from_logits
from core.masked import whiten
from learner.batch import collate, response_slice
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration

TOL = 1e-5


def config(reward_path, *, stage, packing, old_logprobs="recompute"):
    """SGD (scale-sensitive: a wrong gradient sum shows in the weights), 2 epochs x 2 minibatches of 4
    rows in micro-batches of 2; a step small enough that the weights stay where rounding does not
    grow (at lr 0.5 the critic's weights moved by 300 and the two sides parted by 2e-2)."""
    cfg = sgd_config(zero_stage=stage, lr=0.05, packing=packing, old_logprobs=old_logprobs, vf_coef=0.5)
    return dataclasses.replace(cfg, critic="separate", critic_model=reward_path)


class PlainCritic(torch.nn.Module):
    """The reward model's body and score head, as Hugging Face builds them: values [B, R] read at the
    columns that predict the response tokens."""

    def __init__(self, reward_path) -> None:
        from transformers import AutoModelForSequenceClassification

        super().__init__()
        seq = AutoModelForSequenceClassification.from_pretrained(reward_path, dtype=torch.float32)
        self.body = seq.model
        self.head = torch.nn.Linear(seq.config.hidden_size, 1)
        with torch.no_grad():
            self.head.weight.copy_(seq.score.weight)
            self.head.bias.zero_()

    def forward(self, b):
        hidden = self.body(input_ids=b.input_ids, attention_mask=b.attention_mask,
                           position_ids=b.position_ids).last_hidden_state
        return self.head(response_slice(hidden, b.prompt_len, b.response_len)).squeeze(-1)


def plain_logprobs(lm, b):
    logits = lm(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids).logits
    return logprobs_from_logits(response_slice(logits, b.prompt_len, b.response_len), b.response_ids)


def plain_update(policy_path, reward_path, rollouts, cfg, pad_id) -> dict:
    """The PPO update of ``cfg`` (GAE on the critic's values, whitened) in plain torch, full
    minibatches, one process; -> the weights under the learner's names."""
    from transformers import AutoModelForCausalLM

    p = cfg.ppo
    lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32)
    critic = PlainCritic(reward_path)
    batch = collate(rollouts, pad_id)
    mask = batch.response_mask
    with torch.no_grad():
        old_lp = batch.behaviour_logprobs if p.old_logprobs == "behaviour" else plain_logprobs(lm, batch)
        old_lp, old_v = old_lp * mask, critic(batch) * mask
    adv, ret = gae(batch.rewards, old_v, mask, p.gamma, p.lam)
    adv = whiten(adv, mask)
    weights, _ = ppo.behaviour_weights(old_lp, batch.behaviour_logprobs, mask, p.off_policy, p.is_cap)
    params = [*lm.parameters(), *critic.parameters()]
    opt = torch.optim.SGD(params, lr=cfg.optim.lr)
    for _ in range(p.ppo_epochs):
        for start in range(0, len(batch), p.minibatch_size):
            rows = slice(start, start + p.minibatch_size)
            mb, m = batch[rows], mask[rows]
            agg = ppo.Aggregation(mode=p.agg, horizon=cfg.max_new_tokens)
            pg = ppo.policy_loss(plain_logprobs(lm, mb), old_lp[rows], adv[rows], m, p.clip_low, p.clip_high,
                                 p.dual_clip, agg, weights=weights[rows])[0]
            vf = ppo.value_loss(critic(mb), old_v[rows], ret[rows], m, p.value_clip, agg)[0]
            opt.zero_grad()
            (pg + p.vf_coef * vf).backward()
            opt.step()
    out = {f"lm.{k}": v for k, v in lm.named_parameters()}  # tied embeddings: once, as the learner has them
    out.update({f"critic_body.{k}": v for k, v in critic.body.named_parameters()})
    out.update({f"value_head.{k}": v for k, v in critic.head.named_parameters()})
    return {k: v.detach().clone() for k, v in out.items()}


@pytest.mark.parametrize("stage, packing, old_logprobs", [
    (0, True, "recompute"),
    (2, False, "recompute"),
    (0, True, "behaviour"),  # the pre-epoch forward runs the critic alone
])
def test_separate_critic_update_matches_plain_hf_models(policy_path, reward_path, pad_id, stage, packing,
                                                        old_logprobs):
    rollouts = make_rollouts(policy_path, 8, seed=7, response_len=(2, 12))
    cfg = config(reward_path, stage=stage, packing=packing, old_logprobs=old_logprobs)
    w = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    before = w.full_state_dict()
    metrics = w.train(rollouts)
    got = w.full_state_dict()
    want = plain_update(policy_path, reward_path, rollouts, cfg, pad_id)
    moved = max(float((got[k] - before[k]).abs().max()) for k in got if k.startswith("critic_body."))
    diff = max_abs_diff({k: v for k, v in got.items() if k in want}, want)
    print(f"ZeRO-{stage} packing={packing} {old_logprobs}: critic body moved {moved:.2e}, "
          f"max |w - w_plain| = {diff:.2e}, value loss {metrics['ppo/value_loss']:.3f}")
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    assert moved > 1e-3, "the critic body must train measurably"
    assert diff < TOL

"""Shared helpers for the learner tests: synthetic rollouts, learner configs, reference math.

Imported via sys.path (test dirs have no __init__.py): ``from helpers import ...``.
"""
from __future__ import annotations

import numpy as np
import torch

from core import ppo
from core.advantages import gae, per_token_rewards
from core.estimators import AdvantageInputs, EstimatorOptions, estimator
from core.kl import NO_KL, KLPenalty
from core.logprobs import logprobs_from_logits
from core.masked import whiten
from core.rollout import ScoredRollout
from learner.batch import collate
from learner.config import LearnerConfig, OptimConfig, PPOConfig
from learner.objectives.advantage_inputs import placed_rewards


def model_logprobs(model_path_or_lm, prompts, responses, temperature=1.0):
    """[R] logprobs of each response under an HF causal LM (one sequence at a time: no padding)."""
    from transformers import AutoModelForCausalLM

    lm = model_path_or_lm
    if isinstance(lm, str):
        lm = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.as_tensor(np.concatenate([p, r]))[None]
            logits = lm(ids).logits[0, len(p) - 1:-1]
            out.append(logprobs_from_logits(logits, torch.as_tensor(r), temperature).numpy())
    return out


def make_rollouts(model_path, n, *, seed=0, vocab=1024, prompt_len=(3, 8), response_len=(2, 10),
                  beta=0.05, temperature=1.0, lm=None, empty=()):
    """Synthetic ScoredRollouts: random tokens, behaviour logprobs from the model itself
    (ratio ~ 1 at the start), reference = behaviour + noise, rewards via per_token_rewards.
    Rows listed in ``empty`` get a zero-length response."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, vocab, rng.integers(*prompt_len, endpoint=True)) for _ in range(n)]
    responses = [rng.integers(2, vocab, 0 if i in empty else rng.integers(*response_len, endpoint=True))
                 for i in range(n)]
    behaviour = model_logprobs(lm if lm is not None else str(model_path), prompts, responses, temperature)
    rollouts = []
    for i, (p, r, b) in enumerate(zip(prompts, responses, behaviour)):
        ref = (b + rng.normal(0, 0.1, b.shape)).astype(np.float32)
        kl = b - ref
        score = float(rng.normal())
        if r.size:
            rew = per_token_rewards(torch.as_tensor(kl)[None], torch.tensor([score]),
                                        torch.ones(1, r.size), beta)[0].numpy()
        else:
            rew = np.zeros(0, np.float32)
        rollouts.append(ScoredRollout(prompt_ids=p, response_ids=r, behaviour_logprobs=b,
                                      finish_reason="stop", policy_version=0, prompt_index=i,
                                      sample_index=0, reference_logprobs=ref, kl=kl, rewards=rew,
                                      score=score))
    return rollouts


def sgd_config(*, zero_stage=2, lr=0.5, epochs=2, minibatch=4, micro=2, grad_clip=0.0, **ppo_kw):
    """SGD (scale-sensitive, unlike Adam) so wrong gradient sums show up in the weights."""
    return LearnerConfig(zero_stage=zero_stage,
                         optim=OptimConfig(optimizer="sgd", lr=lr, grad_clip=grad_clip),
                         ppo=PPOConfig(ppo_epochs=epochs, minibatch_size=minibatch, micro_batch_size=micro,
                                       shuffle=False, **ppo_kw))


def reference_update(model_path, rollouts, cfg: LearnerConfig, pad_id, kl: KLPenalty = NO_KL, advantages=None,
                     start: dict | None = None):
    """The same PPO update in plain single-process torch: full minibatches, no DeepSpeed.
    With truncated sampling (rollouts with kept sets) the ratio is over the sampler's sets and
    the off-policy weight's numerator over the policy's own set; ``kl``: the KL penalty, a loss
    term when ``kl.in_loss``. ``advantages`` [B, R] (critic-free only): a test's own
    computation of them instead of core/estimators.py's, so the estimator is checked too.
    ``start``: the weights to update from (parameter name -> tensor; default: model_path's).

    Returns (state_dict after the update, list of pre-clip grad norms per step).
    """
    from learner.policy import PolicyWithValueHead

    p = cfg.ppo
    model = PolicyWithValueHead.from_pretrained(model_path, critic=cfg.value_model)
    if start is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(start[name])
    batch = collate(rollouts, pad_id)
    mask = batch.response_mask
    truncation = dict(top_k=cfg.top_k, top_p=cfg.top_p)
    with torch.no_grad():
        old_lp, old_v, _ = model.response_logprobs_values(batch, cfg.temperature, with_entropy=False, **truncation)
        own = model(batch.input_ids, batch.attention_mask, batch.position_ids, prompt_len=batch.prompt_len,
                    temperature=cfg.temperature, with_entropy=False, with_own_set=True, **truncation)[3]
    if p.old_logprobs == "behaviour":
        old_lp = own = batch.behaviour_logprobs
    old_lp, old_v = old_lp * mask, old_v * mask
    own = torch.where(mask != 0, own, 0.0)
    if p.advantage == "gae":
        adv, ret = gae(batch.rewards, old_v, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            adv = whiten(adv, mask)
    else:  # the whole batch in one process: groups are never cut
        adv = critic_free_advantages(rollouts, batch, p) if advantages is None else advantages
        ret = None
    weights, _ = ppo.behaviour_weights(own, batch.behaviour_logprobs, mask, p.off_policy, p.is_cap)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr)
    horizon = cfg.max_new_tokens
    norms = []
    for _ in range(p.ppo_epochs):
        for start in range(0, len(batch), p.minibatch_size):
            rows = slice(start, start + p.minibatch_size)
            mb, m = batch[rows], mask[rows]
            lp, v, ent = model.response_logprobs_values(mb, cfg.temperature, **truncation)
            agg = ppo.Aggregation(mode=p.agg, horizon=horizon)
            pg, _, _ = ppo.policy_loss(lp, old_lp[rows], adv[rows], m, p.clip_low, p.clip_high,
                                       p.dual_clip, agg, weights=weights[rows])
            vf = ppo.value_loss(v, old_v[rows], ret[rows], m, p.value_clip, agg)[0] if ret is not None else 0.0
            loss = pg + p.vf_coef * vf - p.entropy_coef * ppo.aggregate_loss(ent, m, agg)
            if kl.in_loss:
                loss = loss + kl.beta * ppo.kl_loss(lp, mb.reference_logprobs, m, kl.estimator, agg)[0]
            opt.zero_grad()
            loss.backward()
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def critic_free_advantages(rollouts, batch, p):
    """[B, R] the estimator's advantages over the whole batch; a group is (chunk, prompt)."""
    keys = sorted({(r.chunk_id, r.prompt_index) for r in rollouts})
    group = torch.tensor([keys.index((r.chunk_id, r.prompt_index)) for r in rollouts])
    scores = torch.tensor([r.reward_score for r in rollouts], dtype=torch.float64)
    x = AdvantageInputs(rewards=batch.rewards, scores=scores, mask=batch.response_mask, group=group,
                        placed=placed_rewards(rollouts, batch.response_mask)
                        if any(r.placed_rewards is not None for r in rollouts) else None)
    opt = EstimatorOptions(gamma=p.gamma, scale_by_std=p.group_std)
    return estimator(p.advantage).fn(x, opt)[0]


def max_abs_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

"""The PPO update of one data-parallel rank on a DeepSpeed engine.

Every rank holds a shard of whole prompt groups (core.rollout.shard_rollouts), maybe
unequal; the shards in rank order are the global batch. Every rank runs the same minibatches
and micro-batches (learner/objectives/minibatches.py; a rank short of rows runs empty ones), so global
minibatch k holds the rows one process would train in its minibatch k. Losses are
normalised by GLOBAL token (or sequence) counts, so per-rank losses SUM to the global loss;
DeepSpeed AVERAGES gradients over ranks, hence the loss is scaled by world_size before
backward (checked against a single-process reference in the tests).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Optional

import numpy as np
import torch

from core import ppo
from core.choices import resolved_band
from core.corrections import Bounds, correct
from core.estimators import EstimatorOptions, estimator
from core.kl import NO_KL, KLPenalty, kl_estimate
from core.layout import position_ids
from core.masked import explained_variance
from core.rollout import ScoredRollout
from learner.batch import Batch, collate, collate_lm
from learner.collectives import Collectives
from learner.config import LearnerConfig, PPOConfig
from learner.lora import adapter_disabled
from learner.objectives.advantage_inputs import advantage_inputs
from learner.objectives.loss_terms import MicroBatch, TermSettings, micro_batch_loss
from learner.objectives.minibatches import minibatch_plan, split_rows, visit_order
from learner.objectives.objective import Objective
from learner.objectives.stats import UpdateStats, merge_rank_metrics
from learner.objectives.teacher_term import add_teacher_term
from learner.packing import Packed, Padded, row_groups, row_lengths
from learner.policy import PolicyWithValueHead


class PPOObjective(Objective):
    """Scores the shard, computes its advantages (``ppo.advantage``), then runs the clipped-loss epochs."""

    name = "ppo"

    def __init__(self, **parts) -> None:
        super().__init__(**parts)
        self.epoch_history: list[dict] = []  # this rank's per-epoch losses of the last train()
        self.last_ptx_rows: Optional[np.ndarray] = None  # [n, T] PTX rows of the last train()
        self.critic = self.config.value_model != "none"  # a value model to train (gae), or none
        self.row_offset = 0  # this rank's first row in the global batch (the shards in rank order)
        self.layout = Packed if self.config.ppo.packing else Padded  # how a micro-batch enters the forward

    @classmethod
    def load_module(cls, model: str, config: LearnerConfig) -> tuple:
        policy = PolicyWithValueHead.from_pretrained(model, critic=config.value_model,
                                                     critic_model=config.critic_model, lora=config.lora)
        if config.ppo.packing:  # packed rows attend per sequence, not over the whole row (where the family allows)
            policy.use_varlen()
        return policy, policy.lm

    def train(self, shard: list[ScoredRollout], ptx_rows: Optional[np.ndarray] = None,
              kl: KLPenalty = NO_KL, *, step: int = 0) -> dict:
        """``ppo_epochs`` passes over this rank's shard; every rank must call it. ``ptx_rows``
        [n, T]: this rank's PTX text, spread evenly over the update's optimizer steps.
        ``kl``: the step's KL penalty, a loss term when ``kl.in_loss``. ``step``: the updates
        done before this one, which seeds the shuffle (a resumed run replays it)."""
        t0 = time.perf_counter()
        global_tokens, counts = _shard_sizes(self.comm, shard)
        self.row_offset = sum(counts[:self.rank])
        batch = collate(shard, self.pad_id).to(self.device)
        metrics = self._prepare(batch, shard)
        cfg = self.config.ppo
        epochs = _agreed(self.comm, cfg, batch, [_epoch_plan(self.config, self.rank, counts, step, e)
                                                 for e in range(cfg.ppo_epochs)])
        self.last_ptx_rows = None if ptx_rows is None or cfg.ptx_coef == 0 else np.asarray(ptx_rows)
        ptx = _ptx_slices(self.last_ptx_rows, sum(map(len, epochs)), self.pad_id, self.device)
        # Without a recompute, the first minibatch (still at the update's starting weights)
        # is where the learner's log-probs meet the sampler's: the agreement metrics come from it.
        steps = _UpdateSteps(self, batch, kl, probe=[] if cfg.old_logprobs == "behaviour" else None)
        self.epoch_history = []
        for minibatches in epochs:
            before = steps.stats.copy()
            for rows, micros in minibatches:
                steps.minibatch(batch[rows], micros, next(ptx))
                if steps.probe:
                    metrics.update(self._agreement_metrics(steps.probe))
                    steps.probe = None
            self.epoch_history.append(steps.stats.since(before).epoch_summary())
        seconds = time.perf_counter() - t0
        metrics.update(steps.stats.metrics(self.comm.sum, world_size=self.world_size, with_ptx=bool(cfg.ptx_coef),
                                           with_kl_loss=kl.in_loss, with_values=self.critic))
        if kl.in_loss:
            metrics["ppo/kl_loss_coef"] = kl.beta
        metrics.update({"perf/learner_seconds": seconds,
                        "perf/learner_tokens_per_s": global_tokens / seconds,
                        "learner/step": step + 1, "learner/optimizer_steps": self.engine.global_steps,
                        "learner/tokens": global_tokens})
        return metrics

    @torch.no_grad()
    def evaluate(self, rollouts: list) -> list[np.ndarray]:
        """[R] logprobs of each rollout's response under the current weights (all ranks call)."""
        lp = self._score(collate(rollouts, self.pad_id).to(self.device))[0].cpu().numpy()
        return [lp[i, :r.response_ids.size].copy() for i, r in enumerate(rollouts)]

    def reference_logprobs(self, rollouts: list) -> list[np.ndarray]:
        """[R] logprobs of each rollout's response under the base model: the LM with its LoRA
        adapter switched off, which is a LoRA run's reference (all ranks call; through
        ``LearnerGroup.apply``). Scored as ``evaluate`` scores: the sampler's temperature and sets."""
        if self.engine.module.lora is None:
            raise ValueError("learner: reference_logprobs needs learner.lora: without an adapter the base "
                             "weights are the ones being trained")
        with adapter_disabled(self.engine.module.lm):
            return self.evaluate(rollouts)

    @classmethod
    def rank_options(cls, world_size: int, ptx_rows: Optional[np.ndarray] = None, kl: KLPenalty = NO_KL) -> list:
        """Rank r trains the r-th of W equal blocks of the PTX rows, and every rank with the KL penalty ``kl``."""
        return [{"ptx_rows": rows, "kl": kl} for rows in split_rows(ptx_rows, world_size)]

    @classmethod
    def merge_train(cls, per_rank: list[dict]) -> dict:
        return merge_rank_metrics(per_rank)

    @classmethod
    def merge_evaluate(cls, per_rank: list) -> list:
        """The ranks' log-probs in rank order: the rollouts' order when the shards were cut in it."""
        return [lp for rank in per_rank for lp in rank]

    def _forward(self, mb: Batch, with_entropy: bool, values_only: bool = False, with_own_set: bool = False):
        args, where = self.layout.inputs(mb)  # padded rows, or one packed row (learner/packing.py)
        return self.engine(*args, **where, temperature=self.config.temperature, top_k=self.config.top_k,
                           top_p=self.config.top_p, kept_ids=mb.kept_ids, with_entropy=with_entropy,
                           values_only=values_only, with_own_set=with_own_set)

    @torch.no_grad()
    def _prepare(self, batch: Batch, shard: list[ScoredRollout]) -> dict:
        """Old logprobs/values under the current weights, then the advantages (ppo.advantage).

        ``old_logprobs: behaviour`` (sync mode: the sampler ran these very weights) takes the
        sampler's log-probs as pi_old, so only the values need a forward: with a separate
        critic the policy body does not run here at all, and without a critic nothing does.
        """
        cfg = self.config.ppo
        recompute = cfg.old_logprobs == "recompute"
        mask = batch.response_mask
        lp = v = own = None
        if recompute or self.critic:
            lp, v, own = self._score(batch, values_only=not recompute)
        batch.old_logprobs = (lp if recompute else batch.behaviour_logprobs) * mask
        batch.old_values = v * mask if self.critic else torch.zeros_like(mask)
        # The off-policy weight's proximal policy samples from its own kept set (-inf outside);
        # the ratio's anchor is renormalised over the sampler's set, as the update's log-probs are.
        proximal = torch.where(mask != 0, own, 0.0) if recompute else batch.old_logprobs
        batch.advantages, returns = self._advantages(batch, shard)
        teacher = add_teacher_term(batch, self.config.teacher_coef, self.comm.sum) if self.config.teacher_coef else {}
        batch.returns = returns if returns is not None else torch.zeros_like(mask)
        batch.is_weights, corrected = self._correct(proximal, batch.behaviour_logprobs, mask)
        metrics = {**corrected, **(self._value_metrics(batch) if self.critic else self._advantage_metrics(batch))}
        metrics.update(teacher)
        if recompute:
            metrics.update(self._agreement_metrics([(batch.old_logprobs, batch.behaviour_logprobs, mask)],
                                                   proximal))
        return metrics

    def _correct(self, proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> tuple:
        """(weights [B, R], metrics): the rollout correction's (``ppo.off_policy``, core/corrections.py)
        and the fractions of the batch's tokens, over every rank, it truncated and it masked."""
        cfg = self.config.ppo
        lower, upper = resolved_band(cfg.off_policy, cfg.rs_lower, cfg.rs_upper)
        out = correct(proximal, behaviour, mask, cfg.off_policy, Bounds(cap=cfg.is_cap, lower=lower, upper=upper))
        m = mask.double()
        n, s_truncated, s_masked = self.comm.sum([m.sum(), (out.truncated * m).sum(), (out.masked * m).sum()])
        n = max(n, 1.0)
        return out.weights, {"off_policy/truncated_frac": s_truncated / n, "off_policy/masked_frac": s_masked / n}

    def _advantages(self, batch: Batch, shard: list[ScoredRollout]):
        """(advantages, returns or None), [B, R] each, by ``ppo.advantage`` (core/estimators.py).
        Statistics over the batch are sums over every rank (all-reduces); a group estimator sees
        every rank's scores (learner/objectives/advantage_inputs.py)."""
        cfg = self.config.ppo
        chosen = estimator(cfg.advantage)
        inputs = advantage_inputs(batch, shard, comm=self.comm, row_offset=self.row_offset, device=self.device,
                                  with_population=chosen.uses_groups,
                                  values=batch.old_values if self.critic else None)
        options = EstimatorOptions(gamma=cfg.gamma, lam=cfg.lam, scale_by_std=cfg.group_std,
                                   whiten_gae=cfg.whiten_advantages)
        return chosen.fn(inputs, options, reduce=self.comm.sum)

    def _score(self, batch: Batch, values_only: bool = False):
        """(logprobs, values, own-set logprobs), each [B, R] float32 under the current weights,
        micro-batch by micro-batch (policy.forward's ``with_own_set``). ``values_only``: the
        log-probs are None. Under ZeRO-3 every forward is a collective, so every rank runs as many
        (a rank with fewer micro-batches repeats a row, its outputs unused); below it no collective
        runs here, so rank 0 may score alone (reference.on_learner)."""
        # in order: a row's batch-mates as they always were
        groups = _micro_groups(batch, self.config.ppo, by_length=False)
        most = len(groups)
        if self.engine.zero_optimization_stage() == 3:
            (most,) = self.comm.max([most])
        outs = [torch.zeros(batch.response_mask.shape, device=batch.response_mask.device) for _ in range(3)]
        for k in range(int(most)):
            rows = torch.as_tensor(groups[min(k, len(groups) - 1)], device=outs[0].device)
            mic = batch[rows if k < len(groups) else rows[:1]].trimmed()
            if values_only:
                parts = (None, self._forward(mic, with_entropy=False, values_only=True)[1], None)
            else:
                lp, v, _, own = self._forward(mic, with_entropy=False, with_own_set=True)
                parts = (lp, v, own)
            for out, t in zip(outs, parts):
                if t is not None and k < len(groups):  # trimmed columns were padding: they stay zeros
                    out[rows, :t.shape[1]] = t.float()
        return (None, outs[1], None) if values_only else tuple(outs)

    def _value_metrics(self, b: Batch) -> dict:
        m = b.response_mask.double()
        ret, val = b.returns.double(), b.old_values.double()
        n, s_ret, s_val = self.comm.sum([m.sum(), (ret * m).sum(), (val * m).sum()])
        ev = explained_variance(val, ret, b.response_mask, reduce=self.comm.sum)
        return {"ppo/explained_variance": float(ev), "ppo/returns_mean": s_ret / n, "ppo/values_mean": s_val / n}

    def _advantage_metrics(self, b: Batch) -> dict:
        """The critic-free estimators' signal: how big the advantages are, and how much of the
        batch has none (a group whose returns are all equal teaches nothing)."""
        m = b.response_mask.double()
        adv = b.advantages.double() * m
        n, s_abs, s_zero = self.comm.sum([m.sum(), adv.abs().sum(), ((adv == 0).double() * m).sum()])
        return {"advantage/abs_mean": s_abs / n, "advantage/zero_frac": s_zero / n}

    def _agreement_metrics(self, parts: list, proximal=None) -> dict:
        """How far the sampling policy is from the learner's weights at the start of the update,
        whatever ``off_policy`` is: the log-prob gap, KL(behaviour || learner) and the raw weights
        pi_learner / pi_behaviour. ``parts``: (learner_lp, behaviour_lp, mask) triples, [B, R] each,
        over the whole batch (recompute) or the first minibatch's micro-batches (behaviour).
        ``proximal`` [B, R]: the weights' numerator where it differs from learner_lp (truncated
        sampling: the proximal policy's own kept set, -inf outside; one part only)."""
        device = parts[0][2].device  # the rank's (its GPU on CUDA): the sums add tensors made there
        sums, maxes = (torch.zeros(k, dtype=torch.float64, device=device) for k in (5, 2))
        for learner_lp, behaviour_lp, mask in parts:
            m = mask.double()
            learner_lp, behaviour_lp = learner_lp.double() * m, behaviour_lp.double() * m
            log_w = learner_lp - behaviour_lp
            numerator = learner_lp if proximal is None else torch.where(mask != 0, proximal.double(), 0.0)
            w = torch.exp((numerator - behaviour_lp).clamp(max=ppo.LOG_RATIO_LIMIT)) * m
            kl = kl_estimate(behaviour_lp, learner_lp, "k3") * m
            capped = (w > self.config.ppo.is_cap).double() * m
            sums += torch.stack([m.sum(), log_w.abs().sum(), kl.sum(), w.sum(), capped.sum()])
            maxes = torch.maximum(maxes, torch.stack([log_w.abs().max(), w.max()]))
        n, s_gap, s_kl, s_w, s_capped = self.comm.sum(sums.tolist())
        gap_max, w_max = self.comm.max(maxes.tolist())
        return {"ppo/logprob_gap_max": gap_max, "ppo/logprob_gap_mean": s_gap / n,
                "off_policy/behaviour_kl": s_kl / n, "off_policy/is_weight_mean": s_w / n,
                "off_policy/is_weight_max": w_max, "off_policy/capped_frac": s_capped / n}


class _UpdateSteps:
    """The optimizer steps of one train() call and what they accumulate (``stats``): per
    minibatch, each micro-batch's loss (learner/objectives/loss_terms.py) backward, then the
    PTX slice's, which closes one optimizer step. ``probe``: a list that collects each
    micro-batch's (learner log-probs, behaviour log-probs, mask) until the caller takes it."""

    def __init__(self, objective: PPOObjective, batch: Batch, kl: KLPenalty, probe: Optional[list]) -> None:
        self.objective, self.engine = objective, objective.engine
        self.settings = TermSettings(ppo=objective.config.ppo, kl=kl, critic=objective.critic)
        self.horizon = objective.config.max_new_tokens  # seq-mean-token-sum-norm's divisor: a constant
        # What a rank short of rows trains: a row with no valid token (zero loss, whole graph).
        self.blank = dataclasses.replace(batch[:1], response_mask=torch.zeros_like(batch.response_mask[:1])).trimmed()
        self.stats = UpdateStats()
        self.probe = probe

    def minibatch(self, mb: Batch, n_micro: int, ptx) -> None:
        """Accumulate gradients over ``n_micro`` micro-batches (+ PTX), then one optimizer step;
        the blank row fills the micro-batches this rank has no rows for."""
        obj = self.objective
        n_tok, n_seq = obj.comm.sum([mb.num_tokens(), float((mb.response_mask.sum(1) > 0).sum())])
        micros = [mb[rows].trimmed() for rows in _micro_groups(mb, self.settings.ppo)]
        micros += [self.blank] * (n_micro - len(micros))
        for i, mic in enumerate(micros):
            self.stats.add_forward(fed=obj.layout.fed(mic), real=float(mic.attention_mask.sum()))
            self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1 and ptx is None)
            loss = self._micro_loss(mic, n_tok, n_seq)
            self.engine.backward(loss * obj.world_size, scale_wrt_gas=False)
            self._engine_step()
        if ptx is not None:
            self._ptx_step(ptx)

    def _micro_loss(self, mic: Batch, n_tok: float, n_seq: float):
        """[] the micro-batch's share of the minibatch loss (normalised by the minibatch's global
        ``n_tok`` tokens or ``n_seq`` sequences), its terms' and forward's stats added."""
        lp, v, ent = self.objective._forward(mic, with_entropy=True)
        m = mic.response_mask
        if self.probe is not None:
            self.probe.append((lp.detach(), mic.behaviour_logprobs, m))
        local = float(m.sum())
        if local == 0:  # keep every parameter in the graph so ZeRO's reductions line up
            return (lp.sum() + v.sum()) * 0.0
        agg = ppo.Aggregation(mode=self.settings.ppo.agg, global_tokens=n_tok, global_seqs=n_seq,
                              horizon=self.horizon)
        loss = micro_batch_loss(MicroBatch(logprobs=lp, values=v, entropy=ent, batch=mic, agg=agg),
                                self.settings, self.stats, tokens=local)
        self.stats.add_micro_batch(entropy_sum=float((ent.detach() * m).sum()), tokens=local)
        return loss

    def _engine_step(self) -> None:
        """DeepSpeed's step: an optimizer step only at the accumulation boundary."""
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
            return
        lr = engine.get_lr()[0]  # the lr this step uses
        norm = None
        if engine.zero_optimization_stage() == 0:  # no norm recorded without ZeRO; grads are reduced now
            norm = torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters() if p.grad is not None])
        engine.step()
        self.stats.add_optimizer_step(grad_norm=_as_float(norm if norm is not None else engine.get_global_grad_norm()),
                                      lr=lr)

    def _ptx_step(self, ptx) -> None:
        """Backward of ptx_coef x this slice's token-mean LM loss, micro-batch by micro-batch;
        the last micro-batch closes the optimizer step."""
        ids, mask = ptx
        tokens = float(mask[:, 1:].sum())
        micro, coef = self.settings.ppo.micro_batch_size, self.settings.ppo.ptx_coef
        starts = range(0, len(ids), micro)
        for i, lo in enumerate(starts):
            mid, mmask = ids[lo:lo + micro], mask[lo:lo + micro]
            logits, values = self.engine(mid, mmask, position_ids(mmask))
            lm = ppo.ptx_loss(logits[:, :-1], mid[:, 1:], mmask[:, 1:]) * (float(mmask[:, 1:].sum()) / tokens)
            self.stats.ptx_loss += lm.item()
            self.engine.set_gradient_accumulation_boundary(i == len(starts) - 1)
            # Per-rank token mean; DeepSpeed's rank average makes it the mean over ranks. The value
            # head joins the graph at zero weight so ZeRO's gradient reductions line up.
            self.engine.backward(coef * lm + values.sum() * 0.0, scale_wrt_gas=False)
            self._engine_step()


def _shard_sizes(comm: Collectives, shard: list[ScoredRollout]) -> tuple[int, list[int]]:
    """Agree across ranks on sizes before any collective that depends on them:
    (global tokens, rows on each rank)."""
    n = len(shard)
    tokens = sum(r.trained_tokens for r in shard)
    (no_tokens,) = comm.max([float(tokens == 0)])
    (global_tokens,) = comm.sum([tokens])
    counts = [int(row[0]) for row in comm.gather_rows([[n]])]
    if global_tokens == 0:
        raise ValueError(f"learner.train: zero valid response tokens in the batch "
                         f"({sum(counts)} rollouts); drop empty responses before training")
    if min(counts) == 0:
        raise ValueError(f"learner.train: a rank got an empty shard (rows per rank: {counts}); "
                         "shard with core.rollout.shard_rollouts")
    if no_tokens:
        raise ValueError("learner.train: a rank's shard has zero valid response tokens; "
                         "shard so that every rank gets some response tokens")
    return int(global_tokens), counts


def _micro_groups(mb: Batch, cfg: PPOConfig, by_length: bool = True) -> list[np.ndarray]:
    """Row indices of each micro-batch of ``mb`` (learner/packing.py row_groups)."""
    return row_groups(row_lengths(mb), cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, by_length=by_length)


def _epoch_plan(config: LearnerConfig, rank: int, counts: list[int], step: int,
                epoch: int) -> list[tuple[np.ndarray, int]]:
    """(this rank's rows, micro-batches) per minibatch of an epoch: learner/objectives/minibatches.py."""
    cfg = config.ppo
    order = visit_order(sum(counts), seed=config.seed, step=step, epoch=epoch, shuffle=cfg.shuffle)
    return minibatch_plan(counts, rank, order, cfg.minibatch_size, cfg.micro_batch_size)


def _agreed(comm: Collectives, cfg: PPOConfig, batch: Batch, epochs: list) -> list:
    """The minibatch plans with the micro-batch count every rank runs: the most any rank's
    rows need. With a token budget that depends on the rows' lengths, so it takes one
    all-reduce (without, it is the plan's count, which the shard sizes alone give)."""
    local = [len(_micro_groups(batch[rows], cfg)) if len(rows) else 0 for plan in epochs for rows, _ in plan]
    most = iter(int(n) for n in comm.max(local))
    return [[(rows, next(most)) for rows, _ in plan] for plan in epochs]


def _ptx_slices(rows: Optional[np.ndarray], optimizer_steps: int, pad_id: int, device: torch.device):
    """One (ids, mask) slice of the PTX rows per optimizer step: consecutive, near-equal
    parts when there are enough rows, else one row each, cycling. Every rank gets the same
    number of rows, so every rank runs the same number of PTX micro-batches. None: no PTX."""
    if rows is None:
        return itertools.repeat(None)
    parts = (np.array_split(rows, optimizer_steps) if len(rows) >= optimizer_steps
             else [rows[k % len(rows)][None] for k in range(optimizer_steps)])
    return iter([tuple(t.to(device) for t in collate_lm(part, pad_id)) for part in parts])


def _as_float(x) -> float:
    if x is None:
        return float("nan")
    return float(x.item() if isinstance(x, torch.Tensor) else x)

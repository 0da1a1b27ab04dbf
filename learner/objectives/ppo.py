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
from core.estimators import EstimatorOptions, estimator
from core.kl import kl_estimate
from core.layout import position_ids
from core.masked import explained_variance
from core.rollout import ScoredRollout
from learner.batch import Batch, collate, collate_lm
from learner.config import LearnerConfig
from learner.lora import adapter_disabled
from learner.objectives.advantage_inputs import advantage_inputs
from learner.objectives.minibatches import minibatch_plan, split_rows, visit_order
from learner.objectives.objective import Objective
from learner.objectives.stats import UpdateStats, merge_rank_metrics
from learner.packing import Packed, Padded, row_groups, row_lengths
from learner.policy import PolicyWithValueHead


class PPOObjective(Objective):
    """Scores the shard, computes its advantages (``ppo.advantage``), then runs the clipped-loss epochs."""

    name = "ppo"

    def __init__(self, **parts) -> None:
        super().__init__(**parts)
        self.epoch_history: list[dict] = []  # this rank's per-epoch losses of the last train()
        self.last_ptx_rows: Optional[np.ndarray] = None  # [n, T] PTX rows of the last train()
        self.kl_coef = 0.0  # beta of the KL loss term in the current train()
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
              kl_coef: float = 0.0, *, step: int = 0) -> dict:
        """``ppo_epochs`` passes over this rank's shard; every rank must call it. ``ptx_rows``
        [n, T]: this rank's PTX text, spread evenly over the update's optimizer steps.
        ``kl_coef``: beta of the KL loss term when ``config.kl_loss_estimator`` is set.
        ``step``: the updates done before this one, which seeds the shuffle (a resumed run
        replays it)."""
        t0 = time.perf_counter()
        self.kl_coef = float(kl_coef) if self.config.kl_loss_estimator else 0.0
        global_tokens, counts = self._check_shard(shard)
        horizon = self.config.max_new_tokens  # seq-mean-token-sum-norm's divisor: a constant, not this batch's longest
        batch = collate(shard, self.pad_id).to(self.device)
        metrics = self._prepare(batch, shard)
        stats = UpdateStats()
        epochs = self._agreed([self._minibatches(counts, step, e) for e in range(self.config.ppo.ppo_epochs)], batch)
        # What a rank short of rows trains: a row with no valid token (zero loss, whole graph).
        blank = dataclasses.replace(batch[:1], response_mask=torch.zeros_like(batch.response_mask[:1])).trimmed()
        ptx = self._ptx_slices(ptx_rows, sum(map(len, epochs)))
        # Without a recompute, the first minibatch (still at the update's starting weights)
        # is where the learner's log-probs meet the sampler's: the agreement metrics come from it.
        probe = [] if self.config.ppo.old_logprobs == "behaviour" else None
        self.epoch_history = []
        for minibatches in epochs:
            before = stats.copy()
            for rows, micros in minibatches:
                self._minibatch_step(batch[rows], micros, blank, horizon, next(ptx), stats, probe)
                if probe:
                    metrics.update(self._agreement_metrics(probe))
                    probe = None
            self.epoch_history.append(stats.since(before).epoch_summary())
        seconds = time.perf_counter() - t0
        metrics.update(stats.metrics(self.comm.sum, world_size=self.world_size,
                                     with_ptx=bool(self.config.ppo.ptx_coef),
                                     with_kl_loss=self.config.kl_loss_estimator is not None,
                                     with_values=self.critic))
        if self.config.kl_loss_estimator is not None:
            metrics["ppo/kl_loss_coef"] = self.kl_coef
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
    def rank_options(cls, world_size: int, ptx_rows: Optional[np.ndarray] = None, kl_coef: float = 0.0) -> list:
        """Rank r trains the r-th of W equal blocks of the PTX rows, and every rank with beta ``kl_coef``."""
        return [{"ptx_rows": rows, "kl_coef": kl_coef} for rows in split_rows(ptx_rows, world_size)]

    @classmethod
    def merge_train(cls, per_rank: list[dict]) -> dict:
        return merge_rank_metrics(per_rank)

    @classmethod
    def merge_evaluate(cls, per_rank: list) -> list:
        """The ranks' log-probs in rank order: the rollouts' order when the shards were cut in it."""
        return [lp for rank in per_rank for lp in rank]

    def _check_shard(self, shard: list[ScoredRollout]) -> tuple[int, list[int]]:
        """Agree across ranks on sizes before any collective that depends on them:
        (global tokens, rows on each rank)."""
        n = len(shard)
        tokens = sum(r.trained_tokens for r in shard)
        (no_tokens,) = self.comm.max([float(tokens == 0)])
        (global_tokens,) = self.comm.sum([tokens])
        counts = [int(row[0]) for row in self.comm.gather_rows([[n]])]
        self.row_offset = sum(counts[:self.rank])
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
        batch.returns = returns if returns is not None else torch.zeros_like(mask)
        batch.is_weights, _ = ppo.behaviour_weights(proximal, batch.behaviour_logprobs, mask,
                                                    cfg.off_policy, cfg.is_cap)
        metrics = self._value_metrics(batch) if self.critic else self._advantage_metrics(batch)
        if recompute:
            metrics.update(self._agreement_metrics([(batch.old_logprobs, batch.behaviour_logprobs, mask)],
                                                   proximal))
        return metrics

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
        groups = self._groups(batch, by_length=False)  # in order: a row's batch-mates as they always were
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

    def _groups(self, mb: Batch, by_length: bool = True) -> list[np.ndarray]:
        """Row indices of each micro-batch of ``mb`` (learner/packing.py row_groups)."""
        cfg = self.config.ppo
        return row_groups(row_lengths(mb), cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, by_length=by_length)

    def _agreed(self, epochs: list, batch: Batch) -> list:
        """The minibatch plans with the micro-batch count every rank runs: the most any rank's
        rows need. With a token budget that depends on the rows' lengths, so it takes one
        all-reduce (without, it is the plan's count, which the shard sizes alone give)."""
        local = [len(self._groups(batch[rows])) if len(rows) else 0 for plan in epochs for rows, _ in plan]
        most = iter(int(n) for n in self.comm.max(local))
        return [[(rows, next(most)) for rows, _ in plan] for plan in epochs]

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

    def _minibatches(self, counts: list[int], step: int, epoch: int) -> list[tuple[np.ndarray, int]]:
        """(this rank's rows, micro-batches) per minibatch of an epoch: learner/objectives/minibatches.py."""
        cfg = self.config.ppo
        order = visit_order(sum(counts), seed=self.config.seed, step=step, epoch=epoch, shuffle=cfg.shuffle)
        return minibatch_plan(counts, self.rank, order, cfg.minibatch_size, cfg.micro_batch_size)

    def _minibatch_step(self, mb: Batch, n_micro: int, blank: Batch, horizon: int, ptx, stats: UpdateStats,
                        probe=None) -> None:
        """Accumulate gradients over ``n_micro`` micro-batches (+ PTX), then one optimizer step;
        ``blank`` fills the micro-batches this rank has no rows for. ``probe``: a list that
        collects each micro-batch's (learner log-probs, behaviour log-probs, mask)."""
        n_tok, n_seq = self.comm.sum([mb.num_tokens(), float((mb.response_mask.sum(1) > 0).sum())])
        micros = [mb[rows].trimmed() for rows in self._groups(mb)]
        micros += [blank] * (n_micro - len(micros))
        for i, mic in enumerate(micros):
            stats.add_forward(fed=self.layout.fed(mic), real=float(mic.attention_mask.sum()))
            self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1 and ptx is None)
            loss = self._micro_loss(mic, n_tok, n_seq, horizon, stats, probe)
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            self._engine_step(stats)
        if ptx is not None:
            self._ptx_step(ptx, stats)

    def _engine_step(self, stats: UpdateStats) -> None:
        """DeepSpeed's step: an optimizer step only at the accumulation boundary."""
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()
            return
        lr = self.engine.get_lr()[0]  # the lr this step uses
        norm = None
        if self.engine.zero_optimization_stage() == 0:  # no norm recorded without ZeRO; grads are reduced now
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.engine.module.parameters()
                                                  if p.grad is not None])
        self.engine.step()
        stats.add_optimizer_step(grad_norm=_as_float(norm if norm is not None
                                                     else self.engine.get_global_grad_norm()), lr=lr)

    def _micro_loss(self, mic: Batch, n_tok: float, n_seq: float, horizon: int, stats: UpdateStats, probe=None):
        cfg = self.config.ppo
        lp, v, ent = self._forward(mic, with_entropy=True)
        m = mic.response_mask
        if probe is not None:
            probe.append((lp.detach(), mic.behaviour_logprobs, m))
        local = float(m.sum())
        if local == 0:  # keep every parameter in the graph so ZeRO's reductions line up
            return (lp.sum() + v.sum()) * 0.0
        agg = ppo.Aggregation(mode=cfg.agg, global_tokens=n_tok, global_seqs=n_seq, horizon=horizon)
        pg, clip_frac, approx_kl = ppo.policy_loss(lp, mic.old_logprobs, mic.advantages, m, cfg.clip_low,
                                                   cfg.clip_high, cfg.dual_clip, agg, weights=mic.is_weights)
        loss, vf, vf_clip = pg, torch.zeros(()), torch.zeros(())
        if self.critic:
            vf, vf_clip = ppo.value_loss(v, mic.old_values, mic.returns, m, cfg.value_clip, agg)
            loss = loss + cfg.vf_coef * vf
        if self.config.kl_loss_estimator is not None:  # the KL to the reference, with its gradient
            kl, kl_mean = ppo.kl_loss(lp, mic.reference_logprobs, m, self.config.kl_loss_estimator, agg)
            loss = loss + self.kl_coef * kl
            stats.kl_loss += kl.item()
            stats.kl_sum += kl_mean.item() * local
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ppo.aggregate_loss(ent, m, agg)
        stats.add_micro_batch(policy_loss=pg.item(), value_loss=vf.item(),
                              entropy_sum=float((ent.detach() * m).sum()), approx_kl=approx_kl.item(),
                              clip_frac=clip_frac.item(), vf_clip_frac=vf_clip.item(), tokens=local)
        return loss

    def _ptx_slices(self, rows: Optional[np.ndarray], optimizer_steps: int):
        """One (ids, mask) slice of the PTX rows per optimizer step: consecutive, near-equal
        parts when there are enough rows, else one row each, cycling. Every rank gets the same
        number of rows, so every rank runs the same number of PTX micro-batches."""
        if rows is None or self.config.ppo.ptx_coef == 0:
            self.last_ptx_rows = None
            return itertools.repeat(None)
        self.last_ptx_rows = np.asarray(rows)
        parts = (np.array_split(self.last_ptx_rows, optimizer_steps) if len(rows) >= optimizer_steps
                 else [self.last_ptx_rows[k % len(rows)][None] for k in range(optimizer_steps)])
        return iter([tuple(t.to(self.device) for t in collate_lm(part, self.pad_id)) for part in parts])

    def _ptx_step(self, ptx, stats: UpdateStats) -> None:
        """Backward of ptx_coef x this slice's token-mean LM loss, micro-batch by micro-batch;
        the last micro-batch closes the optimizer step."""
        ids, mask = ptx
        tokens = float(mask[:, 1:].sum())
        micro = self.config.ppo.micro_batch_size
        starts = range(0, len(ids), micro)
        for i, lo in enumerate(starts):
            mid, mmask = ids[lo:lo + micro], mask[lo:lo + micro]
            logits, values = self.engine(mid, mmask, position_ids(mmask))
            lm = ppo.ptx_loss(logits[:, :-1], mid[:, 1:], mmask[:, 1:]) * (float(mmask[:, 1:].sum()) / tokens)
            stats.ptx_loss += lm.item()
            self.engine.set_gradient_accumulation_boundary(i == len(starts) - 1)
            # Per-rank token mean; DeepSpeed's rank average makes it the mean over ranks. The value
            # head joins the graph at zero weight so ZeRO's gradient reductions line up.
            self.engine.backward(self.config.ppo.ptx_coef * lm + values.sum() * 0.0, scale_wrt_gas=False)
            self._engine_step(stats)


def _as_float(x) -> float:
    if x is None:
        return float("nan")
    return float(x.item() if isinstance(x, torch.Tensor) else x)

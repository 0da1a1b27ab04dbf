"""LearnerWorker: one DeepSpeed ZeRO rank running PPO updates (LearnerGroup, in group.py: the ranks on Ray).

Data parallelism: every rank holds an equal shard of the batch. Global minibatch k
is the union of every rank's local minibatch k. Losses are normalised by GLOBAL
token (or sequence) counts, so per-rank losses SUM to the global loss; DeepSpeed
AVERAGES gradients over ranks, hence the loss is scaled by world_size before
backward (checked against a single-process reference in the tests).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from core.rollout import ScoredRollout
from core import ppo
from learner.batch import Batch, collate, collate_lm
from learner.config import LearnerConfig
from learner.policy import PolicyWithValueHead
from learner.weight_sync import DEFAULT_BUCKET_BYTES, make_weight_sync

log = logging.getLogger(__name__)

DS_DIR, POLICY_DIR = "deepspeed", "policy"


# --------------------------------------------------------------------------- setup helpers


def node_ip_and_free_port() -> tuple[str, int]:
    """This node's IP and a currently free TCP port (rank 0's rendezvous address)."""
    try:
        import ray
        ip = ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray: single-node use
        ip = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ip, s.getsockname()[1]


def join_process_group(rank: int, world_size: int, master_addr: Optional[str],
                       master_port: Optional[int], timeout_s: float) -> str:
    """Join (or reuse) the default torch.distributed group; returns the backend.

    The timeout turns a dead peer into an error in every collective instead of a hang.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"learner: process already in a group as rank {dist.get_rank()}/"
                               f"{dist.get_world_size()}, asked to be {rank}/{world_size}")
        return dist.get_backend()
    if master_addr is None or master_port is None:
        if world_size > 1:
            raise ValueError("learner: master_addr and master_port are required when world_size > 1")
        master_addr, master_port = "127.0.0.1", node_ip_and_free_port()[1]
    # DeepSpeed reads these for its own bookkeeping; Ray gives each GPU actor one device.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port))
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def _as_float(x) -> float:
    if x is None:
        return float("nan")
    return float(x.item() if isinstance(x, torch.Tensor) else x)


# --------------------------------------------------------------------------- the rank


class LearnerWorker:
    """One data-parallel rank. A plain class; cluster code wraps it with ray.remote."""

    def __init__(self, *, rank: int, world_size: int, model: str, config: LearnerConfig | dict,
                 master_addr: Optional[str] = None, master_port: Optional[int] = None) -> None:
        import deepspeed

        self.config = config if isinstance(config, LearnerConfig) else LearnerConfig.from_dict(config)
        self.config.validate(world_size)
        self.config.check_device(torch.cuda.is_available())
        self.rank, self.world_size, self.model_path = rank, world_size, str(model)
        self.backend = join_process_group(rank, world_size, master_addr, master_port,
                                          self.config.dist_timeout_s)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(self.config.seed)
        policy = PolicyWithValueHead.from_pretrained(model, critic=self.config.critic,
                                                     critic_model=self.config.critic_model)
        if self.config.gradient_checkpointing:
            policy.lm.gradient_checkpointing_enable()
        policy.train()  # HF loads in eval mode; checkpointing needs train mode (dropout is off anyway)
        self.pad_id = _pad_id(policy.config)
        self.tied_embeddings = bool(getattr(policy.config, "tie_word_embeddings", False))
        optim_cfg = self.config.optim
        optimizer = optim_cfg.build(policy.parameters())
        # A plain closure: LambdaLR then leaves it out of its state_dict (checkpoints stay picklable).
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: optim_cfg.lr_factor(s))
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=policy, optimizer=optimizer, lr_scheduler=scheduler,
            config=self.config.deepspeed_config(world_size), dist_init_required=False)
        self.step = 0  # completed train() calls; seeds the shuffle so a resumed run replays it
        self.epoch_history: list[dict] = []  # this rank's per-epoch loss / clip stats of the last train()
        self._sync = None  # rank 0's NCCL transport: its group outlives a push
        self._sync_key: tuple = ()

    @property
    def module(self) -> PolicyWithValueHead:
        return self.engine.module

    # ------------------------------------------------------------------ collectives

    def _all(self, values: Sequence[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._comm_device())
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def _comm_device(self):
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ training

    def train(self, shard: list[ScoredRollout], ptx_batch: Optional[list] = None) -> dict:
        """One PPO update (``ppo_epochs`` passes) on this rank's shard; every rank must call it."""
        t0 = time.perf_counter()
        global_tokens, horizon = self._check_shard(shard)
        batch = collate(shard, self.pad_id).to(self.device)
        stats = self._prepare(batch)
        ptx = self._ptx_inputs(ptx_batch)
        acc = defaultdict(float)
        local_mb = self.config.ppo.minibatch_size // self.world_size
        self.epoch_history = []
        for epoch in range(self.config.ppo.ppo_epochs):
            before = dict(acc)
            for rows in self._minibatches(len(batch), local_mb, epoch):
                self._update(batch[rows], horizon, ptx, acc)
            self.epoch_history.append(_epoch_stats(before, acc))
        self.step += 1
        seconds = time.perf_counter() - t0
        metrics = {**stats, **self._reduce_metrics(acc)}
        metrics.update({"perf/learner_seconds": seconds,
                        "perf/learner_tokens_per_s": global_tokens / seconds,
                        "learner/step": self.step, "learner/optimizer_steps": self.engine.global_steps,
                        "learner/tokens": global_tokens})
        return metrics

    def _check_shard(self, shard: list[ScoredRollout]) -> tuple[int, int]:
        """Agree across ranks on sizes before any collective that depends on them."""
        n = len(shard)
        tokens = sum(int(r.response_ids.size) for r in shard)
        max_r = max((int(r.response_ids.size) for r in shard), default=0)
        n_max, neg_n_min, no_tokens, horizon = self._all(
            [n, -n, float(tokens == 0), max_r], op=dist.ReduceOp.MAX)
        (global_tokens,) = self._all([tokens])
        if global_tokens == 0:
            raise ValueError(f"learner.train: zero valid response tokens in the batch "
                             f"({int(n_max)} rollouts per rank); drop empty responses before training")
        if n_max != -neg_n_min or n == 0:
            raise ValueError(f"learner.train: ranks got unequal or empty shards (rank {self.rank}: {n}, "
                             f"max {int(n_max)}); LearnerGroup.train shards evenly")
        if no_tokens:
            raise ValueError("learner.train: a rank's shard has zero valid response tokens; "
                             "shard so that every rank gets some response tokens")
        return int(global_tokens), int(horizon)

    def _forward(self, mb: Batch, with_entropy: bool):
        return self.engine(mb.input_ids, mb.attention_mask, mb.position_ids, prompt_len=mb.prompt_len,
                           temperature=self.config.temperature, with_entropy=with_entropy)

    @torch.no_grad()
    def _prepare(self, batch: Batch) -> dict:
        """Old logprobs/values under the current weights, GAE, globally whitened advantages."""
        cfg = self.config.ppo
        lp, v = self._score(batch)
        mask = batch.response_mask
        batch.old_logprobs, batch.old_values = lp * mask, v * mask
        adv, batch.returns = ppo.gae(batch.rewards, batch.old_values, mask, cfg.gamma, cfg.lam)
        batch.advantages = self._whiten(adv, mask) if cfg.whiten_advantages else adv
        return self._prepare_metrics(batch)

    def _score(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, values) [B, R] float32 under the current weights, micro-batch by micro-batch."""
        R, lps, vals = batch.response_len, [], []
        for mic in batch.split(self.config.ppo.micro_batch_size):
            lp, v, _ = self._forward(mic.trimmed(), with_entropy=False)
            pad = (0, R - lp.shape[1])  # trimmed columns were padding: put them back as zeros
            lps.append(torch.nn.functional.pad(lp.float(), pad))
            vals.append(torch.nn.functional.pad(v.float(), pad))
        return torch.cat(lps), torch.cat(vals)

    def _whiten(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ppo.whiten with mean and biased variance over the GLOBAL batch (two all-reduces)."""
        m = mask.double()
        total, count = self._all([(x.double() * m).sum().item(), m.sum().item()])
        mean = total / count
        (sq,) = self._all([(((x.double() - mean) ** 2) * m).sum().item()])
        out = (x.double() - mean) / np.sqrt(sq / count + 1e-8)
        return (out * m).to(x.dtype)

    def _prepare_metrics(self, b: Batch) -> dict:
        m = b.response_mask.double()
        ret, val = b.returns.double(), b.old_values.double()
        gap = (b.behaviour_logprobs.double() - b.old_logprobs.double()).abs() * m
        n, s_r, s_r2, s_e, s_e2, s_gap, s_v, s_score = self._all(
            [m.sum(), (ret * m).sum(), (ret ** 2 * m).sum(), ((ret - val) * m).sum(),
             ((ret - val) ** 2 * m).sum(), gap.sum(), (val * m).sum(), b.scores.double().sum()])
        (gap_max,) = self._all([gap.max().item()], op=dist.ReduceOp.MAX)
        var_r = s_r2 / n - (s_r / n) ** 2
        var_e = s_e2 / n - (s_e / n) ** 2
        return {"ppo/explained_variance": 1.0 - var_e / var_r if var_r > 0 else float("nan"),
                "ppo/logprob_gap_max": gap_max, "ppo/logprob_gap_mean": s_gap / n,
                "ppo/returns_mean": s_r / n, "ppo/values_mean": s_v / n,
                "ppo/score_mean": s_score / (len(b) * self.world_size)}

    def _minibatches(self, n: int, size: int, epoch: int) -> list[np.ndarray]:
        # Seeded by (seed, step, epoch): identical on resume; rank-local like DistributedSampler.
        order = np.arange(n)
        if self.config.ppo.shuffle:
            rng = np.random.default_rng([self.config.seed, self.step, epoch, self.rank])
            order = rng.permutation(n)
        return [order[i:i + size] for i in range(0, n, size)]

    def _update(self, mb: Batch, horizon: int, ptx, acc: dict) -> None:
        """Accumulate gradients over micro-batches (+ PTX), then one optimizer step."""
        cfg = self.config.ppo
        n_tok, n_seq = self._all([mb.num_tokens(), float((mb.response_mask.sum(1) > 0).sum())])
        # Length-sorted micro-batches pad less; the minibatch (so the gradient) is unchanged.
        lengths = mb.response_mask.sum(1) + mb.attention_mask[:, :mb.prompt_len].sum(1)
        micros = mb[torch.argsort(lengths, stable=True)].split(cfg.micro_batch_size)
        for i, mic in enumerate(micros):
            self.engine.set_gradient_accumulation_boundary(i == len(micros) - 1 and ptx is None)
            loss = self._micro_loss(mic.trimmed(), n_tok, n_seq, horizon, acc)
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            self._step(acc)
        if ptx is not None:
            self.engine.set_gradient_accumulation_boundary(True)
            self.engine.backward(self._ptx_loss(ptx, acc), scale_wrt_gas=False)
            self._step(acc)

    def _step(self, acc: dict) -> None:
        boundary = self.engine.is_gradient_accumulation_boundary()
        norm = None
        if boundary:
            acc["lr"] = self.engine.get_lr()[0]  # the lr this step uses
            if self.config.zero_stage == 0:  # DeepSpeed records no norm without ZeRO; grads are reduced by now
                norm = torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters()
                                                      if p.grad is not None])
        self.engine.step()
        if boundary:
            acc["grad_norm"] += _as_float(norm if norm is not None else self.engine.get_global_grad_norm())
            acc["steps"] += 1

    def _micro_loss(self, mic: Batch, n_tok: float, n_seq: float, horizon: int, acc: dict):
        cfg = self.config.ppo
        lp, v, ent = self._forward(mic, with_entropy=True)
        m = mic.response_mask
        local = float(m.sum())
        if local == 0:  # keep every parameter in the graph so ZeRO's reductions line up
            return (lp.sum() + v.sum()) * 0.0
        kw = dict(agg=cfg.agg, global_tokens=n_tok, global_seqs=n_seq, horizon=horizon)
        pg, clip_frac, approx_kl = ppo.policy_loss(lp, mic.old_logprobs, mic.advantages, m, cfg.clip_low,
                                                   cfg.clip_high, cfg.dual_clip, **kw)
        vf, vf_clip = ppo.value_loss(v, mic.old_values, mic.returns, m, cfg.value_clip, **kw)
        ent_loss = ppo.aggregate_loss(ent, m, cfg.agg, n_tok, n_seq, horizon)
        loss = pg + cfg.vf_coef * vf
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent_loss
        acc["pg"] += pg.item()
        acc["vf"] += vf.item()
        acc["ent_sum"] += float((ent.detach() * m).sum())
        acc["kl_sum"] += approx_kl.item() * local
        acc["clip_sum"] += clip_frac.item() * local
        acc["vfclip_sum"] += vf_clip.item() * local
        acc["tok"] += local
        return loss

    def _ptx_inputs(self, ptx_batch):
        if ptx_batch is None or self.config.ppo.ptx_coef == 0:
            return None
        ids, mask = collate_lm(ptx_batch, self.pad_id)
        return ids.to(self.device), mask.to(self.device)

    def _ptx_loss(self, ptx, acc: dict):
        ids, mask = ptx
        logits, values = self.engine(ids, mask, (mask.cumsum(-1) - 1).clamp_min(0))
        lm = ppo.ptx_loss(logits[:, :-1], ids[:, 1:], mask[:, 1:])
        acc["ptx"] += lm.item()
        # Per-rank token mean; DeepSpeed's rank average makes it the mean over ranks.
        return self.config.ppo.ptx_coef * lm + values.sum() * 0.0

    def _reduce_metrics(self, acc: dict) -> dict:
        keys = ("pg", "vf", "ptx", "ent_sum", "kl_sum", "clip_sum", "vfclip_sum", "tok")
        pg, vf, ptx, ent, kl, clip, vfclip, tok = self._all([acc[k] for k in keys])
        steps = max(acc["steps"], 1)
        out = {"ppo/policy_loss": pg / steps, "ppo/value_loss": vf / steps,
               "ppo/entropy": ent / tok, "ppo/approx_kl": kl / tok, "ppo/clip_frac": clip / tok,
               "ppo/vf_clip_frac": vfclip / tok, "ppo/grad_norm": acc["grad_norm"] / steps,
               "ppo/lr": acc["lr"]}
        if self.config.ppo.ptx_coef:
            out["ppo/ptx_loss"] = ptx / (steps * self.world_size)
        return out

    @torch.no_grad()
    def policy_logprobs(self, rollouts: list) -> list[np.ndarray]:
        """[R] logprobs of each rollout's response under the current weights (all ranks call)."""
        lp = self._score(collate(rollouts, self.pad_id).to(self.device))[0].cpu().numpy()
        return [lp[i, :r.response_ids.size].copy() for i, r in enumerate(rollouts)]

    # ------------------------------------------------------------------ weights out

    def _gathered(self, named, bucket_bytes: int):
        """Yield (name, full CPU tensor) on rank 0; under ZeRO-3 all ranks gather group by group."""
        import deepspeed

        named = list(named)
        if self.config.zero_stage != 3:
            if self.rank == 0:  # views of the live weights: consume before the next step
                yield from ((n, p.detach()) for n, p in named)
            return
        group, size = [], 0
        for i, (name, p) in enumerate(named):
            group.append((name, p))
            size += getattr(p, "ds_numel", p.numel()) * p.element_size()
            if size >= bucket_bytes or i == len(named) - 1:
                with deepspeed.zero.GatheredParameters([q for _, q in group], modifier_rank=None):
                    # Cloned: the gathered storage is released when the context exits.
                    copies = [(n, q.detach().to("cpu", copy=True)) for n, q in group] if self.rank == 0 else []
                yield from copies
                group, size = [], 0

    def named_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        """Full LM tensors with HF names on rank 0 (nothing elsewhere). ALL ranks must iterate it."""
        return self._gathered(self.module.lm.named_parameters(), bucket_bytes)

    def full_state_dict(self) -> Optional[dict]:
        """Every trainable tensor of the module (LM, value head, critic) on rank 0; all ranks call."""
        out = {n: t.clone() for n, t in self._gathered(self.module.named_parameters(), DEFAULT_BUCKET_BYTES)}
        return out if self.rank == 0 else None

    def push_weights(self, generators: list, version: int,
                     bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Optional[dict]:
        """Send the current LM to every generator; rank 0 returns the sync report.

        ``config.weight_sync`` picks the transport: "cpu" (safetensors buckets through Ray)
        or "nccl" (broadcast from this rank's GPU; the group is formed on the first push and
        kept while the generator list stays the same).
        """
        named = self.named_weights(bucket_bytes)
        if self.rank != 0:
            for _ in named:  # take part in the ZeRO-3 gathers
                pass
            return None
        if self.config.weight_sync == "cpu":
            sync = make_weight_sync("cpu", generators, bucket_bytes=bucket_bytes)
            return sync.push(version, named, tied_embeddings=self.tied_embeddings)
        return self._nccl_sync(generators, bucket_bytes).push(
            version, named, tied_embeddings=self.tied_embeddings, metadata=self._lm_metadata())

    def _nccl_sync(self, generators: list, bucket_bytes: int):
        key = tuple(_handle_key(g) for g in generators)
        if self._sync is None or key != self._sync_key:
            self.shutdown_weight_sync()
            self._sync = make_weight_sync("nccl", generators, bucket_bytes=bucket_bytes)
            self._sync_key = key
        return self._sync

    def shutdown_weight_sync(self) -> None:
        """Release the NCCL group (if any) on both sides; the next nccl push forms a new one."""
        if self._sync is not None:
            sync, self._sync, self._sync_key = self._sync, None, ()
            sync.shutdown()

    def _lm_metadata(self) -> list[tuple]:
        """(name, dtype, full shape) of each tensor named_weights yields, without gathering."""
        return [(n, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))
                for n, p in self.module.lm.named_parameters()]

    # ------------------------------------------------------------------ checkpoints

    def save(self, out_dir) -> str:
        """Full resumable state (DeepSpeed checkpoint) + the HF policy under out_dir/policy."""
        out = Path(out_dir)
        self.engine.save_checkpoint(str(out / DS_DIR), tag=f"step{self.step}",
                                    client_state={"tether_step": self.step})
        self.save_pretrained_policy(out / POLICY_DIR)
        if self.world_size > 1:
            dist.barrier()
        return str(out)

    def load(self, in_dir) -> int:
        """Restore model, optimizer, scheduler and step from ``save``; returns the step."""
        path, client = self.engine.load_checkpoint(str(Path(in_dir) / DS_DIR))
        if path is None:
            raise FileNotFoundError(f"learner.load: no DeepSpeed checkpoint under {Path(in_dir) / DS_DIR}")
        self.step = int(client.get("tether_step", 0))
        return self.step

    def save_pretrained_policy(self, out_dir) -> Optional[str]:
        state = self.full_state_dict()
        if self.rank != 0:
            return None
        return str(self.module.save_pretrained(out_dir, state_dict=state))

    def health(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "ok": True, "step": self.step,
                "optimizer_steps": int(self.engine.global_steps), "zero_stage": self.config.zero_stage,
                "backend": self.backend, "device": str(self.device), "model": self.model_path}


def _epoch_stats(before: dict, after: dict) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps, tok = max(d.get("steps", 0), 1), max(d.get("tok", 0), 1)
    return {"policy_loss": d.get("pg", 0.0) / steps, "value_loss": d.get("vf", 0.0) / steps,
            "clip_frac": d.get("clip_sum", 0.0) / tok, "approx_kl": d.get("kl_sum", 0.0) / tok}


def _handle_key(generator):
    """Identity of a generator across calls (a Ray handle is re-created on every pickle)."""
    actor_id = getattr(generator, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else id(generator)


def _pad_id(config) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(config, attr, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0  # padding is masked out; any id works


# The Ray side lives in learner/group.py; re-exported so callers import both from here.
from learner.group import LearnerGroup  # noqa: E402,F401

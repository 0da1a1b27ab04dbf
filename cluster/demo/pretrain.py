"""A briefly pre-trained tiny policy, and corpus batches for the learner's PTX loss.

A randomly initialised policy emits noise: RL on it mostly teaches it to stop. The demo
instead starts from the tiny Qwen2 of `cluster.demo.tiny_models` trained for a few hundred
steps (plain torch AdamW, causal LM loss, CPU) on the built-in corpus with EOS appended
to every sentence, so it writes corpus-like sentences, ends them with EOS, and picks
positive and negative words about equally often: the sentiment reward starts near 0 and
RL has room to push it up.

The result is cached on disk under a key covering the base model, the recipe and its
hyperparameters, so only the first call pays (~tens of seconds on 2 CPU cores).

    python -m cluster.demo.pretrain          # build (or find) the default, print its path and stats
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from cluster.demo.sentiment import corpus
from cluster.demo.tiny_models import TinySpec, build_policy, cache_root, cached_build, run_apart

if TYPE_CHECKING:
    import torch

RECIPE_VERSION = 2  # bump when the training recipe changes, so old caches are not reused
DEFAULT_STEPS = 300
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 3e-3
DEFAULT_SEQ_LEN = 32  # every corpus sentence + EOS fits (the longest is ~15 tokens)


def _corpus_ids(tokenizer_path: str | Path, texts: list[str] | None = None) -> tuple[list[np.ndarray], int | None]:
    """Every sentence of `texts` (default: 2000 of the built-in corpus) tokenized (no special
    tokens) with EOS appended."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer at {tokenizer_path} has no eos_token; the corpus needs one")
    enc = tok(corpus(2000) if texts is None else texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(ids + [tok.eos_token_id], dtype=np.int64) for ids in enc], tok.pad_token_id


def _pad_rows(rows: list[np.ndarray], seq_len: int, pad_id: int):
    import torch

    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
    for i, r in enumerate(rows):
        r = r[:seq_len]
        ids[i, : r.size] = torch.from_numpy(r)
        mask[i, : r.size] = 1
    return ids, mask


def ptx_batches(tokenizer_path: str | Path, batch_size: int, seq_len: int = DEFAULT_SEQ_LEN,
                seed: int = 0, *, texts: list[str] | None = None) -> Iterator[tuple["torch.Tensor", "torch.Tensor"]]:
    """Endless `(input_ids [B,T] long, mask [B,T] long)` batches of `texts` (default: the
    built-in corpus).

    One sentence per row, EOS appended, right-padded with the tokenizer's pad token (EOS
    if it has none) to T = seq_len (longer sentences are cut). mask is 1 on real tokens
    (EOS included) and 0 on padding; the LM loss is next-token cross-entropy on positions
    whose target is real: targets input_ids[:, 1:] weighted by mask[:, 1:]. Rows start at
    position 0 with no BOS, the same layout generation sees. The sentence order is
    reshuffled every pass over the corpus with a generator seeded by `seed`, so the stream
    is reproducible.
    """
    if batch_size < 1 or seq_len < 2:
        raise ValueError(f"ptx_batches: batch_size must be >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
    rows, pad_id = _corpus_ids(tokenizer_path, texts)
    if pad_id is None:
        pad_id = int(rows[0][-1])
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(len(rows)), 0
    while True:
        take = []
        while len(take) < batch_size:
            if pos == len(order):
                order, pos = rng.permutation(len(rows)), 0
            take.append(rows[order[pos]])
            pos += 1
        yield _pad_rows(take, seq_len, pad_id)


def lm_loss(model, input_ids, mask) -> "torch.Tensor":
    """Mean next-token cross-entropy over positions whose target is a real token."""
    import torch.nn.functional as F

    logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    weight = mask[:, 1:].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (nll * weight.reshape(-1)).sum() / weight.sum().clamp_min(1.0)


def corpus_loss(model_path: str | Path, n_batches: int = 8, batch_size: int = 64, seed: int = 1) -> float:
    """Mean LM loss of the model at `model_path` on corpus batches (for checks and reports)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    batches = ptx_batches(model_path, batch_size, seed=seed)
    with torch.no_grad(), _one_thread():
        losses = [lm_loss(model, *next(batches)).item() for _ in range(n_batches)]
    return float(np.mean(losses))


@contextlib.contextmanager
def _one_thread():
    """Run torch on one thread: a ~1M-param model gains little from more, and on busy shared
    cores OpenMP spin-waits made 2 threads ~10x slower than 1 (measured: 280 s vs 26 s).
    Larger specs (SPEC_30M) keep torch's default thread count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _pretrain_apart(base: Path, out: Path, *, one_thread: bool, **recipe) -> None:
    """``_pretrain`` in a fresh interpreter (tiny_models.run_apart: the model's bits must not
    depend on what the calling process loaded before); ``one_thread``: torch on one thread."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "recipe.json"
        spec.write_text(json.dumps({"base": str(base), "out": str(out), "one_thread": one_thread, **recipe}))
        run_apart("cluster.demo.pretrain", str(spec), what=f"the pre-trained policy {out.name}")


def _build_from(spec_path: str) -> None:
    """The child's side of ``_pretrain_apart``: the recipe from its JSON file."""
    recipe = json.loads(Path(spec_path).read_text())
    base, out, one_thread = Path(recipe.pop("base")), Path(recipe.pop("out")), recipe.pop("one_thread")
    with _one_thread() if one_thread else contextlib.nullcontext():
        _pretrain(base, out, **recipe)


def pretrained_key(spec: TinySpec, steps: int, batch_size: int, lr: float, seed: int,
                   texts: list[str] | None = None) -> str:
    """The cache key of a pre-trained policy. `texts` other than the built-in corpus add a hash
    of their content; the built-in corpus adds nothing, so the default policy's key (and every
    cache built before `texts` existed) stays what it was."""
    fields = {"base": spec.key("policy"), "recipe": RECIPE_VERSION, "steps": steps,
              "batch_size": batch_size, "lr": lr, "seed": seed, "seq_len": DEFAULT_SEQ_LEN}
    if texts is not None:
        fields["corpus"] = hashlib.sha256("\n".join(texts).encode()).hexdigest()
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _pretrain(base: Path, out: Path, *, steps: int, batch_size: int, lr: float, seed: int,
              texts: list[str] | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 10)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    batches = ptx_batches(base, batch_size, DEFAULT_SEQ_LEN, seed, texts=texts)
    start, curve = time.perf_counter(), []
    for _ in range(steps):
        ids, mask = next(batches)
        keep = int(mask.sum(1).max())  # trim the all-padding tail columns: same loss, less work
        loss = lm_loss(model, ids[:, :keep], mask[:, :keep])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        curve.append(round(loss.item(), 4))
    seconds = time.perf_counter() - start
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(out)
    final = float(np.mean(curve[-20:]))
    (out / "pretrain.json").write_text(json.dumps(
        {"base": str(base), "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
         "seconds": round(seconds, 2), "final_loss": round(final, 4), "loss_curve": curve}, indent=1))


def build_pretrained_policy(spec: TinySpec = TinySpec(), steps: int = DEFAULT_STEPS, seed: int = 0, *,  # noqa: B008
                            batch_size: int = DEFAULT_BATCH_SIZE, lr: float = DEFAULT_LR,
                            texts: list[str] | None = None) -> Path:
    """The tiny policy of `spec`, pre-trained on `texts` (default: the built-in corpus, the
    sentiment demo's); HF format, tokenizer beside it. Another task's corpus (e.g.
    cluster.demo.arithmetic) gives a policy of its own, cached under a key of its own.

    AdamW (weight decay 0.01, betas 0.9/0.95), linear warm-up over the first 10% of steps
    then cosine decay to 10% of `lr`, gradient norm clipped at 1.0, fp32 on CPU. The run's
    loss curve and wall time are written to `pretrain.json` in the model folder.
    """
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"build_pretrained_policy: steps, batch_size and lr must be positive, "
                         f"got {steps}, {batch_size}, {lr}")
    base = build_policy(spec)

    h, f = spec.hidden_size, spec.intermediate_size
    small = spec.vocab_size * h + spec.num_hidden_layers * (4 * h * h + 3 * h * f) < 5_000_000

    def build(out: Path) -> None:
        _pretrain_apart(base, out, steps=steps, batch_size=batch_size, lr=lr, seed=seed, texts=texts,
                        one_thread=small)

    key = pretrained_key(spec, steps, batch_size, lr, seed, texts)
    return cached_build(cache_root() / f"policy-pretrained-{key}", build)


def _main() -> None:
    if sys.argv[1:2] == ["--build"]:  # a build's own process (_pretrain_apart)
        _build_from(sys.argv[2])
        return
    path = build_pretrained_policy()
    stats = json.loads((path / "pretrain.json").read_text())
    print("pretrained policy:", path)
    print(f"steps {stats['steps']}  batch {stats['batch_size']}  {stats['seconds']} s  "
          f"final loss {stats['final_loss']}  corpus loss {corpus_loss(path):.3f}  "
          f"(random init {corpus_loss(stats['base']):.3f})")


if __name__ == "__main__":
    _main()

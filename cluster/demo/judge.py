"""A tiny judge model built offline: the pre-trained tiny policy taught to grade a response.

After ``JUDGE_TEMPLATE`` (the prompt, the response, then ``Score:``) it writes `` 1`` and EOS
for a response the sentiment task likes (more positive than negative lexicon words:
``cluster.demo.sentiment.is_positive``) and `` 0`` otherwise. With greedy decoding it always
answers with a digit (every verdict of 200 held-out rows read); it agrees with ``is_positive``
on clear one-word cases (tests/actors/rewards/test_judge.py pins six) and on 169 of those 200 rows,
missing mostly mixed responses ("sweet and sad."): a judge whose verdicts a test can predict.

It is trained for a few hundred steps (AdamW, CPU, loss on the verdict and EOS only) on
template-formatted rows of the demo's prompts and responses: one-word completions of either
sentiment, mixed and neutral ones, and random token strings (so that whatever the response,
the judge still answers with a digit). Cached like every tiny model.

    python -m cluster.demo.judge             # build (or find) it, print its path and accuracy
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
import time
from pathlib import Path

from cluster.demo.pretrain import build_pretrained_policy
from cluster.demo.sentiment import NEGATIVE_WORDS, PLACES, POSITIVE_WORDS, builtin_prompts, completion, is_positive
from cluster.demo.tiny_models import cache_root, cached_build, run_apart

# The judge's prompt: reward.judge.template's default is the same text.
JUDGE_TEMPLATE = "Prompt: {prompt}\nResponse: {response}\nScore:"
RECIPE_VERSION = 1
STEPS, BATCH_SIZE, LR, SEED = 400, 32, 2e-3, 0


def judge_rows(n: int, seed: int = 0) -> list[tuple[str, str, int]]:
    """(prompt, response, verdict 0/1) rows: the responses a policy writes, of every sentiment."""
    rng = random.Random(seed)
    prompts = builtin_prompts(320, seed)
    words = POSITIVE_WORDS + NEGATIVE_WORDS
    makers = (lambda: completion(rng, POSITIVE_WORDS), lambda: completion(rng, NEGATIVE_WORDS),
              lambda: f" {rng.choice(PLACES)}.",
              lambda: f" {rng.choice(words)} and {rng.choice(words)}.",
              lambda: " " + " ".join(rng.choice(words + PLACES) for _ in range(rng.randint(1, 5))),
              lambda: " " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz .,!?0123456789") for _ in range(
                  rng.randint(0, 24))))
    rows = []
    for _ in range(n):
        prompt, response = rng.choice(prompts), rng.choice(makers)()
        rows.append((prompt, response, int(is_positive([prompt], [response])[0])))
    return rows


def _encode(tok, rows):
    """Token ids of each rendered row + verdict + EOS, and how many trailing tokens are the answer."""
    out = []
    for prompt, response, verdict in rows:
        context = tok(JUDGE_TEMPLATE.format(prompt=prompt, response=response), add_special_tokens=False)["input_ids"]
        answer = tok(f" {verdict}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((context + answer, len(answer)))
    return out


def _train(base: Path, out: Path) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    data = _encode(tok, judge_rows(STEPS * BATCH_SIZE, SEED))
    start, curve = time.perf_counter(), []
    for step in range(STEPS):
        batch = data[step * BATCH_SIZE:(step + 1) * BATCH_SIZE]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        weight = torch.zeros((len(batch), width))
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (row, n_answer) in enumerate(batch):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
            weight[i, len(row) - n_answer:len(row)] = 1.0  # the loss is on the verdict and EOS only
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * weight[:, 1:].reshape(-1)).sum() / weight[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(round(loss.item(), 4))
    model.eval().save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "judge.json").write_text(json.dumps(
        {"base": str(base), "template": JUDGE_TEMPLATE, "steps": STEPS, "batch_size": BATCH_SIZE, "lr": LR,
         "seconds": round(time.perf_counter() - start, 2), "loss_curve": curve}, indent=1))


BUILTIN_JUDGE = "builtin:judge"


def judge_path(name: str) -> str:
    """reward.judge.model as the engine loads it: builtin:judge built (cached), else as given."""
    return str(build_judge()) if name == BUILTIN_JUDGE else name


def build_judge() -> Path:
    """The tiny judge (HF format, tokenizer beside it), built on first use and cached."""
    base = build_pretrained_policy()
    key = hashlib.sha256(json.dumps({"base": str(base.name), "v": RECIPE_VERSION, "template": JUDGE_TEMPLATE,
                                     "steps": STEPS, "batch": BATCH_SIZE, "lr": LR, "seed": SEED},
                                    sort_keys=True).encode()).hexdigest()[:16]

    def build(out: Path) -> None:  # one thread: a ~1M-param model gains nothing from more
        run_apart("cluster.demo.judge", str(base), str(out), what="the tiny judge")

    return cached_build(cache_root() / f"judge-{key}", build)


def greedy_verdicts(path: Path, rows: list[tuple[str, str, int]]) -> list[str]:
    """What the judge at ``path`` writes after each row's rendered template (HF greedy, 3 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response, _ in rows:
            ids = tok(JUDGE_TEMPLATE.format(prompt=prompt, response=response), return_tensors="pt")["input_ids"]
            gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
            out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def _main() -> None:
    if sys.argv[1:2] == ["--build"]:  # a build's own process (tiny_models.run_apart)
        import torch

        torch.set_num_threads(1)
        _train(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    path = build_judge()
    rows = judge_rows(200, seed=123)
    said = greedy_verdicts(path, rows)
    agree = sum(s.strip() == str(v) for s, (_, _, v) in zip(said, rows))
    print("judge:", path, json.loads((path / "judge.json").read_text())["seconds"], "s")
    print(f"agrees with is_positive on {agree}/{len(rows)} held-out rows; e.g. {said[:8]}")


if __name__ == "__main__":
    _main()

"""The SFT and reward-model steps of a LearnerWorker (1 rank, in-process, real DeepSpeed on CPU)
against plain torch: the SFT loss counts the response tokens only, the reward model scores
the last real token, and both losses fall when trained; packed micro-batches train the padded
ones' weights; an adapter's dropout regularises training but never the held-out loss or scores."""
import numpy as np
import pytest
import torch
from helpers import max_abs_diff

from core.modeling.varlen_attention import VARLEN
from learner.config import OptimConfig, SupervisedConfig
from learner.lora_config import LoraConfig
from learner.objectives.preference import PreferenceObjective
from learner.objectives.sft import SFTObjective
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration


def _rows(n, seed, parts=2):
    """Random token rows: a prompt of 3-6 tokens, then ``parts - 1`` responses of 2-5 tokens."""
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(2, 1000, rng.integers(3, 7) if k == 0 else rng.integers(2, 6)) for k in range(parts))
            for _ in range(n)]


def _config(lr=1e-3, **kw):
    return SupervisedConfig(**{"zero_stage": 2, "optim": OptimConfig(lr=lr, grad_clip=1.0), "critic": "shared",
                               "batch_size": 4, "micro_batch_size": 2, **kw})


def _response_nll_by_hand(lm, rows):
    """Token mean of -log p(response token | everything before), one row at a time (no padding)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, response in rows:
            ids = torch.as_tensor(np.concatenate([prompt, response]))[None]
            logp = torch.log_softmax(lm(ids).logits[0].double(), -1)
            for j, tok in enumerate(response):
                total -= float(logp[len(prompt) + j - 1, tok])
                count += 1
    return total / count


@pytest.fixture(scope="module")
def sft_worker(policy_path):
    return LearnerWorker(rank=0, world_size=1, model=policy_path, config=_config(), objective=SFTObjective)


def test_sft_loss_is_response_only_and_falls(sft_worker, policy_path):
    from transformers import AutoModelForCausalLM

    rows = _rows(6, seed=3)
    lm = AutoModelForCausalLM.from_pretrained(policy_path, dtype=torch.float32).eval()
    by_hand = _response_nll_by_hand(lm, rows)
    got = sft_worker.evaluate(rows)
    # had the prompt tokens counted too, the two would differ by far more than float noise
    assert got["loss"] == pytest.approx(by_hand, abs=1e-4)
    assert got["tokens"] == sum(len(r) for _, r in rows)
    train = _rows(8, seed=4)
    first = sft_worker.train(train)
    for _ in range(4):
        last = sft_worker.train(train)
    print(f"sft loss {first['loss'][0]:.3f} -> {last['loss'][-1]:.3f}")
    assert len(first["loss"]) == 2  # 8 rows / 4 per optimizer step
    assert last["loss"][-1] < first["loss"][0] - 0.5


def test_reward_step_scores_last_token_and_learns(policy_path, tmp_path):
    from transformers import AutoModelForSequenceClassification

    w = LearnerWorker(rank=0, world_size=1, model=policy_path, config=_config(lr=3e-3),
                      objective=PreferenceObjective)
    pairs = _rows(8, seed=6, parts=3)
    # Learnable preference: the chosen response repeats token 7, the rejected token 9.
    pairs = [(p, np.concatenate([c, [7, 7]]), np.concatenate([r, [9, 9]])) for p, c, r in pairs]
    before = w.evaluate(pairs)
    for _ in range(6):
        out = w.train(pairs)
    after = w.evaluate(pairs)
    print(f"rm loss {before['loss']:.3f} -> {after['loss']:.3f}, accuracy {before['accuracy']} -> {after['accuracy']}")
    assert after["loss"] < before["loss"] and after["accuracy"] == 1.0 and out["accuracy"][-1] == 1.0
    # The saved checkpoint is a plain HF sequence classifier scoring as the step does.
    out_dir = w.save_pretrained_policy(tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(out_dir).eval()
    seqs = [(p, c) for p, c, _ in pairs[:3]]
    with torch.no_grad():
        by_hf = [float(hf(torch.as_tensor(np.concatenate(s))[None]).logits[0, 0]) for s in seqs]
    assert w.apply(PreferenceObjective.scores, seqs) == pytest.approx(by_hf, abs=1e-4)


@pytest.mark.parametrize("objective, stage", [(SFTObjective, 2), (SFTObjective, 3), (PreferenceObjective, 2)])
def test_packed_micro_batches_train_the_padded_weights(policy_path, objective, stage):
    """Ragged rows (prompts 3-6, responses 2-5 tokens, pairs with responses of unequal length):
    the losses, the eval and the weights after two optimizer steps of SGD (scale-sensitive)
    agree packed and padded, in fp32."""
    rows = _rows(8, seed=11, parts=2 if objective is SFTObjective else 3)
    out = {}
    for packing in (False, True):
        cfg = _config(optim=OptimConfig(optimizer="sgd", lr=0.5, grad_clip=0.0), zero_stage=stage, packing=packing)
        torch.manual_seed(0)  # the reward model's fresh score head
        w = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg, objective=objective)
        body = getattr(w.engine.module, "lm", None) or w.engine.module.model
        assert body.config._attn_implementation == (VARLEN if packing else "sdpa")  # the path under test
        before = w.full_state_dict()
        first = w.evaluate(rows)
        trained = w.train(rows)
        out[packing] = (first, trained, w.evaluate(rows), w.full_state_dict())
        assert max_abs_diff(out[packing][3], before) > 1e-2, "the steps must move the weights measurably"
    (e0, t0, a0, s0), (e1, t1, a1, s1) = out[False], out[True]
    assert e1["loss"] == pytest.approx(e0["loss"], abs=1e-5) and a1["loss"] == pytest.approx(a0["loss"], abs=1e-5)
    assert t1["loss"] == pytest.approx(t0["loss"], abs=1e-5)
    assert max_abs_diff(s1, s0) < 1e-5


@pytest.mark.parametrize("objective", [SFTObjective, PreferenceObjective])
def test_adapter_dropout_is_off_when_evaluating_and_scoring(policy_path, objective):
    """With learner.lora.dropout > 0 the held-out loss, and the reward scores reward_stats.json is
    built from, are the same on every call; training gets its dropout back after."""
    torch.manual_seed(0)
    w = LearnerWorker(rank=0, world_size=1, model=policy_path, objective=objective,
                      config=_config(lr=1e-2, lora=LoraConfig(rank=8, dropout=0.5)))
    rows = _rows(4, seed=21, parts=2 if objective is SFTObjective else 3)
    w.train(rows)  # B leaves zero: the adapter, and so its dropout, now moves the outputs
    first, second = w.evaluate(rows), w.evaluate(rows)
    print(f"{objective.name} held-out loss {first['loss']:.4f}, again {second['loss']:.4f}")
    assert second["loss"] == first["loss"]
    if objective is PreferenceObjective:
        responses = [(p, c) for p, c, _ in rows] + [(p, r) for p, _, r in rows]
        scores = [w.apply(PreferenceObjective.scores, responses) for _ in range(2)]
        print(f"rm scores move by {np.abs(scores[1] - scores[0]).max():.4f} between two calls")
        assert np.array_equal(scores[0], scores[1])
    dropouts = [m for n, m in w.engine.module.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Dropout) and m.training for m in dropouts)

"""bf16 training on real DeepSpeed (CPU): gradients accumulate over micro-batches in fp32, and
the value head computes and returns fp32."""
import dataclasses

import pytest
import torch
from helpers import make_rollouts, sgd_config

from learner.batch import collate
from learner.policy import PolicyWithValueHead, body_of
from learner.worker import LearnerWorker

pytestmark = pytest.mark.integration


def micro_loss(module, mic):
    """A loss of the log-probs (so the whole LM gets a gradient), scaled like a token mean."""
    lp, v, _ = module(mic.input_ids, mic.attention_mask, mic.position_ids, prompt_len=mic.prompt_len,
                      with_entropy=False)
    m = mic.response_mask
    return ((lp * m).pow(2).sum() - (lp * m).sum() + (v * m).pow(2).sum()) / 50.0


def accumulated_error(engine, micros, reference_module) -> float:
    """||accumulated gradient - sum of the micro-batches' own gradients|| / ||that sum||.

    The reference sums, in float64, the bf16 gradient of each micro-batch computed alone by
    ``reference_module`` (bf16 weights equal to the engine's): what is left is the error of the
    accumulation itself."""
    from deepspeed.utils import safe_get_full_grad
    params = [p for p in reference_module.parameters() if p.requires_grad]
    ref = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for mic in micros:
        grads = torch.autograd.grad(micro_loss(reference_module, mic), params, allow_unused=True)
        for r, g in zip(ref, grads):
            if g is not None:
                r += g.double()
    for i, mic in enumerate(micros):
        engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
        engine.backward(micro_loss(engine, mic), scale_wrt_gas=False)
        if i < len(micros) - 1:
            engine.step()
    got = [safe_get_full_grad(p) for p in engine.module.parameters() if p.requires_grad]
    assert all(g.dtype == torch.float32 for g in got)
    num = sum(float((g.double().reshape(r.shape) - r).pow(2).sum()) for g, r in zip(got, ref))
    return (num / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_gradients_accumulate_in_fp32(policy_path, pad_id, stage):
    """8 micro-batches of 2: summed in bf16 the gradient is ~0.4% off the sum of its parts
    (the bf16 rounding of every partial sum); in fp32, ~2e-9."""
    cfg = dataclasses.replace(sgd_config(zero_stage=stage), dtype="bfloat16")
    worker = LearnerWorker(rank=0, world_size=1, model=policy_path, config=cfg)
    engine = worker.engine
    micros = collate(make_rollouts(policy_path, 16, seed=1), pad_id).split(2)
    error = accumulated_error(engine, micros, engine.module)
    print(f"ZeRO-{stage} bf16: accumulated gradient relative error {error:.2e}")
    assert error < 1e-5


def test_bf16_value_head_computes_in_fp32(policy_path, pad_id):
    model = PolicyWithValueHead.from_pretrained(policy_path, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.no_grad():
        model.value_head.weight.normal_(0, 1.0)
        model.value_head.bias.fill_(0.3)
    batch = collate(make_rollouts(policy_path, 4, seed=2), pad_id)
    with torch.no_grad():
        _, values = model(batch.input_ids, batch.attention_mask, batch.position_ids)
        _, response_values, _ = model.response_logprobs_values(batch, with_entropy=False)
        hidden = body_of(model.lm)(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   position_ids=batch.position_ids).last_hidden_state
    head = model.value_head
    expected = torch.nn.functional.linear(hidden.double(), head.weight.double(), head.bias.double()).squeeze(-1)
    assert model.value_head.weight.dtype == torch.bfloat16
    assert values.dtype == response_values.dtype == torch.float32
    error = float((values.double() - expected).abs().max() / expected.abs().max())
    print(f"bf16 value head: relative error {error:.2e}")
    assert error < 1e-5  # a bf16 matmul output is rounded to ~4e-3

"""bench.learner's GPU figures, the cheap parts: the FLOP count and MFU (bench/peak.py), the
measured-peak helper on a small CPU matmul, the --dtype/--device flags and the policy sizes."""
import pytest
import torch

from bench.mfu import mfu
from bench.peak import matmul_peak, mfu_line, trainable_params, update_flops

pytestmark = pytest.mark.unit


def test_update_flops_counts_six_n_per_response_token_and_every_pass_per_position():
    f = update_flops(params=1_000_000, rollouts=64, prompt_tokens=16, new_tokens=128, epochs=4)
    assert f["response"] == 6e6 * 64 * 128
    assert f["all"] == (2 + 6 * 4) * 1e6 * 64 * (16 + 128)
    # the response count over a second and a peak is bench/mfu.py's MFU at the same tokens/s
    assert f["response"] / 2.0 / 790e12 == pytest.approx(mfu(1_000_000, 64 * 128 / 2.0, 790e12))


def test_mfu_line_names_both_counts():
    line = mfu_line("tether-z2", 2.0, {"response": 4e12, "all": 8e12}, 100e12)
    assert line.startswith("learner bench: tether-z2 MFU 2% by bench/mfu.py's count")
    assert "; 4% = 4 TFLOP/s counting every position" in line


def test_trainable_params_counts_zero3_partitions_whole_and_skips_frozen():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    assert trainable_params(model) == 4 * 3 + 3 + 3 * 2 + 2
    model[1].weight.requires_grad_(False)
    model[0].weight.ds_numel = 1000  # what ZeRO-3 leaves on a partitioned parameter
    assert trainable_params(model) == 1000 + 3 + 2


def test_matmul_peak_on_a_small_cpu_product():
    peak = matmul_peak(torch.device("cpu"), torch.float32, n=64, rounds=1, per_round=1)
    assert peak["flops_per_s"] > 0 and (peak["n"], peak["dtype"], peak["tf32"]) == (64, "float32", False)


def test_bf16_flag_is_the_learner_dtype_knob():
    from bench.learner import config, parse_args
    from learner.config import LearnerConfig

    wl = {"value": "unused"}
    for flag, enabled in (("bfloat16", True), ("float32", False)):
        args = parse_args(["--dtype", flag, "--critic", "shared"])
        ds = LearnerConfig.from_dict(config(args, wl, 2)).deepspeed_config(1)
        assert ds["bf16"] == {"enabled": enabled}
    assert parse_args([]).dtype == "float32" and parse_args([]).device == "cpu"


def test_cuda_without_a_gpu_is_a_one_line_error(monkeypatch, capsys):
    from bench.learner import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        parse_args(["--device", "cuda"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "python -m bench.learner: error: --device cuda, but torch sees no CUDA device\n"


def test_large_is_qwen2_5_0_5b_shaped():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.sizes import SIZES, sized_workload

    s = SIZES["large"]
    config = Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                         num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                         num_key_value_heads=s.num_key_value_heads, tie_word_embeddings=s.tie_word_embeddings)
    with torch.device("meta"):  # shapes only: no memory, no init
        n = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert n == 494_032_768  # Qwen2.5-0.5B's count
    wl = {"policy": "p"}
    assert sized_workload(wl, "bench") is wl
    with pytest.raises(ValueError, match="policy size 'huge'"):
        sized_workload(wl, "huge")

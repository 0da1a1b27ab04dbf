"""bench/mfu.py, the GPU check's report: the MFU arithmetic, the peak table, the medians."""
import pytest
import torch

from bench.mfu import count_params, mfu, peak_flops, report, summarize

pytestmark = pytest.mark.unit


def test_mfu_is_six_n_flops_per_token_over_the_peak():
    assert mfu(1_000_000_000, 1000.0, 989e12) == pytest.approx(6e12 / 989e12)
    assert mfu(7_000_000_000, 3000.0, 312e12) == pytest.approx(0.4038, abs=1e-4)  # 7B at 3k tok/s on an A100


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 SXM5 80GB", 989e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-PCIE-40GB", None), ("NVIDIA L40S", 362e12),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("Tesla T4", None)])
def test_peak_table(name, peak):
    got, why = peak_flops(name)
    assert got == peak
    assert (why == "") == (peak is not None) and (peak is not None or name in why)


def rows(n: int) -> list[dict]:
    out = [{"step": 0, "perf/startup_seconds": 30.0}]  # step 0 carries no training figure
    for s in range(1, n + 1):
        out.append({"step": s, "perf/learner_tokens_per_s": 100.0 * s, "perf/tokens_per_s": 10.0 * s,
                    "perf/sync_seconds": 0.5 if s <= 2 else 0.01, "perf/sync_bytes": 4e6})
    return out


def test_summarize_takes_medians_after_the_warmup():
    got = summarize(rows(20), warmup=5)
    assert got["steps"] == (6, 20)
    assert got["learner_tokens_per_s"] == 1300.0 and got["tokens_per_s"] == 130.0 and got["sync_seconds"] == 0.01
    assert summarize(rows(3), warmup=5)["steps"] == (1, 3)  # a short run keeps every step
    with pytest.raises(ValueError, match="no training step"):
        summarize(rows(0), warmup=5)


def test_report_lines(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(10, 100), "b": torch.zeros(24)}, str(tmp_path / "model.safetensors"))
    save_file({"v": torch.zeros(1, 5)}, str(tmp_path / "value_head.safetensors"))
    params = count_params(tmp_path)
    assert params == 1029
    figures = summarize(rows(20), warmup=5)
    lines = report(figures, params=1_000_000_000, gpu_name="NVIDIA H200", gpus=1, weight_sync="ipc")
    assert lines[0] == "gpu-check: NVIDIA H200 x1, weight_sync=ipc, medians over steps 6-20"
    assert "1,300 tokens/s, MFU 0.789% (6 x 1000.00M params" in lines[1]  # 6e9 x 1300 / 989e12
    assert lines[2].endswith("130 tokens/s") and "0.0100 s per push (4.00 MB)" in lines[3]
    unknown = report(figures, params=params, gpu_name="Tesla T4", gpus=2, weight_sync="nccl")
    assert "MFU n/a: no peak bf16 FLOP/s listed for 'Tesla T4'" in unknown[1]
    with pytest.raises(ValueError, match="no safetensors weights"):
        count_params(tmp_path / "missing")

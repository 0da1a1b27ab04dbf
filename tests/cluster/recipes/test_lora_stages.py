"""The SFT and reward-model stages train LoRA adapters too, and PPO starts from an SFT adapter or
its merged model. Real entrypoints in subprocesses (local Ray, DeepSpeed on CPU), tiny data."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_stages import COMMON, cli, metrics, run_sft, write_jsonl

from cluster.demo.sentiment import builtin_rows

pytestmark = pytest.mark.integration
LORA = ["learner.lora.rank=8", "learner.optim.lr=0.005"]
IDS = torch.tensor([[5, 17, 301, 44, 9, 88]])


@pytest.fixture(scope="module")
def sft_lora(tmp_path_factory):
    return run_sft(tmp_path_factory.mktemp("sft"), "sft-lora", 1, *LORA)


def test_sft_trains_an_adapter_and_ppo_starts_from_it(sft_lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from cluster.runtime.state.models import resolve_model

    loss = [r["sft/loss"] for r in metrics(sft_lora) if "sft/loss" in r]
    print(f"sft LoRA: loss {loss[0]:.3f} -> {loss[-1]:.3f}")
    assert np.mean(loss[-3:]) < np.mean(loss[:3]) - 0.1
    final = sft_lora / "checkpoints" / "final"
    adapter = final / "adapter"
    base = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    with torch.no_grad():
        want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)(IDS).logits
        exported = AutoModelForCausalLM.from_pretrained(final)(IDS).logits  # the merged SFT model
        # model.policy=<the adapter folder>: PPO starts from its base with it merged (built once, cached)
        merged = resolve_model(str(adapter))
        started = AutoModelForCausalLM.from_pretrained(merged)(IDS).logits
    assert (want - AutoModelForCausalLM.from_pretrained(base)(IDS).logits).abs().max() > 1e-3
    assert (want - exported).abs().max() < 1e-4 and (want - started).abs().max() < 1e-4
    assert Path(merged) not in (adapter, final, Path(base))  # a folder of its own
    # Asked again: the same folder, not built a second time (its files are the ones the first call left).
    built = files_of(Path(merged))
    assert resolve_model(str(adapter)) == merged and files_of(Path(merged)) == built


def files_of(folder: Path) -> dict:
    """Each file of a model folder: its inode and modification time (a build writes new files)."""
    return {f.relative_to(folder): (f.stat().st_ino, f.stat().st_mtime_ns) for f in folder.rglob("*")}


# The slow tier: a second stage start-up. The default tier: tests/learner/test_lora_config.py::
# test_a_reward_model_adapter_trains_its_score_head_and_exports_merged holds the adapter's score head and merge.
@pytest.mark.slow
def test_reward_model_stage_trains_an_adapter(sft_lora, tmp_path):
    from transformers import AutoModelForSequenceClassification

    data = write_jsonl(tmp_path / "pairs.jsonl", builtin_rows("rm", 112, seed=2))
    r = cli("cluster.reward_model", f"run.dir={tmp_path}", "run.name=rm", f"model.base={sft_lora}",
            f"data.path={data}", "train.epochs=3", *COMMON, *LORA)
    assert r.returncode == 0, r.stderr[-3000:]
    accuracy = [row["rm/eval_accuracy"] for row in metrics(tmp_path / "rm") if "rm/eval_accuracy" in row]
    print(f"rm LoRA: held-out accuracy {accuracy}")
    assert accuracy[-1] > accuracy[0]
    final = tmp_path / "rm" / "checkpoints" / "final"
    assert AutoModelForSequenceClassification.from_pretrained(final).config.num_labels == 1
    assert (final / "adapter" / "adapter_model.safetensors").is_file()

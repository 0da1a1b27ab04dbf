"""User mistakes through the real SFT / reward-model entrypoints, and the PPO-side refusals
that their outputs bring (reward.normalize, reference.model): one line, exit 2, no traceback.
None of these starts Ray: each fails in the config or in prepare()."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from entrypoints import assert_one_line_error

from cluster.runtime.state.lineage import tether_warning, write_stage

pytestmark = pytest.mark.integration  # each case runs an entrypoint in a child process
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, reward_path) -> Path:
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("stage-inputs")
    (d / "no_response.jsonl").write_text("".join(json.dumps({"prompt": "The cat was", "answer": " good."}) + "\n"
                                                  for _ in range(4)))
    (d / "no_rejected.jsonl").write_text("".join(json.dumps({"prompt": "The cat was", "chosen": " good."}) + "\n"
                                                 for _ in range(4)))
    shutil.copytree(reward_path, d / "rm_without_stats")
    # a model directory with another vocabulary size: not a valid reference for the tiny policy
    from transformers import Qwen2Config, Qwen2ForCausalLM
    Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(d / "other_vocab")
    AutoTokenizer.from_pretrained(reward_path).save_pretrained(d / "tokenizer_only")
    return d


CASES = [
    ("cluster.sft", ["train.epocs=2"], "unknown key train.epocs; did you mean train.epochs?"),
    ("cluster.sft", ["data.path=/nonexistent/sft.jsonl"], "data.path: /nonexistent/sft.jsonl does not exist"),
    ("cluster.sft", ["data.path={inputs}/no_response.jsonl"],
     "data.response_field='response' is in none of the 4 rows"),
    ("cluster.sft", ["train.batch_size=6", "learner.replicas=2", "train.micro_batch_size=2"],
     "train.batch_size=6 is not divisible by learner.replicas x train.micro_batch_size = 4"),
    ("cluster.sft", ["model.base=/nonexistent/model"], "model.base='/nonexistent/model' does not exist"),
    ("cluster.sft", ["model.base={inputs}/tokenizer_only"], "is not a Hugging Face model directory"),
    ("cluster.sft", ["data.chat_template=true"], "data.chat_template is true but the tokenizer"),
    ("cluster.sft", ["data.max_seq_len=3"], "no usable rows in builtin"),
    ("cluster.reward_model", ["model.base=builtin:tiny", "data.path={inputs}/no_rejected.jsonl"],
     "data.rejected_field='rejected' is in none of the 4 rows"),
    ("cluster.reward_model", ["model.base=builtin:tiny", "train.margin=oops"], "train.margin must be float"),
    ("cluster.reward_model", ["model.base={inputs}"], "is not a Hugging Face model directory"),
    ("cluster.train", ["reward.function=null", "reward.model={inputs}/rm_without_stats", "reward.normalize=true"],
     "reward_stats.json does not exist; train the reward model with python -m cluster.reward_model"),
    ("cluster.train", ["reward.normalize=true"], "reward.normalize standardises reward-model scores; set reward.model"),
    ("cluster.train", ["reference.model={inputs}/other_vocab"], "has vocab_size=512 but the policy has 1024"),
    ("cluster.train", ["reference.model={inputs}/tokenizer_only"], "is not a Hugging Face model directory"),
]


IDS = [f"{m.split('.')[1]}-{i}" for i, (m, _, _) in enumerate(CASES)]


@pytest.mark.parametrize("module, args, message", CASES, ids=IDS)
def test_user_mistake_exits_2_with_one_line(tmp_path, inputs, entrypoints, module, args, message):
    run_dir = tmp_path / "runs"
    args = [a.format(inputs=inputs) for a in args]
    result = entrypoints.run(module, [f"run.dir={run_dir}", *args], env={"RAY_ADDRESS": "", "DS_ACCELERATOR": "cpu"})
    assert_one_line_error(result, run_dir, message.format(inputs=inputs))


@pytest.mark.parametrize("case", ["sft-2", "reward_model-9"])  # one per stage entrypoint, as a user runs it
def test_user_mistake_in_a_fresh_interpreter(tmp_path, inputs, case):
    (module, args, message), run_dir = CASES[IDS.index(case)], tmp_path / "runs"
    env = {**os.environ, "RAY_ADDRESS": "", "DS_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, "-m", module, f"run.dir={run_dir}",
                             *(a.format(inputs=inputs) for a in args)], cwd=REPO,
                            text=True, capture_output=True, timeout=300, env=env)
    assert_one_line_error(result, run_dir, message.format(inputs=inputs))


def test_tether_warning_from_stage_files(tmp_path):
    base, sft, other = tmp_path / "base", tmp_path / "sft", tmp_path / "other"
    for d in (base, sft, other):
        d.mkdir()
    write_stage(sft, "sft", str(base))
    assert "is the base model the policy's SFT started from" in tether_warning(str(sft), str(base))
    assert "is not an SFT output" in tether_warning(str(sft), str(other))
    write_stage(other, "sft", str(base))
    assert tether_warning(str(sft), str(other)) is None  # another SFT model: a deliberate choice
    assert tether_warning(str(base), str(other)) is None  # nothing known about the policy


@pytest.mark.parametrize("name, cls", [("sft-tiny.yaml", "SFTConfig"), ("rm-tiny.yaml", "RMConfig")])
def test_shipped_stage_configs_validate(name, cls):
    import cluster.config.stages as sc

    cfg = sc.load_stage_config(getattr(sc, cls), REPO / "configs" / name)
    assert cfg.train.epochs >= 1 and cfg.learner_config().batch_size == cfg.train.batch_size

"""Every user mistake through the real entrypoint: one line on stderr, exit 2, no run folder.

Each case runs `python -m cluster.train run.dir=<empty dir> ...` in a process of its own, forked
from one that imported the stack once (tests/entrypoints.py); three run in a fresh interpreter
as well. None of them starts Ray: config mistakes fail in load_config, data/model/reward
mistakes in prepare(), both before the run folder is made.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from entrypoints import assert_one_line_error

from actors.rewards.source import one_source_rule

pytestmark = pytest.mark.integration  # each case runs an entrypoint in a child process
REPO = Path(__file__).resolve().parents[3]

# Reward functions that the driver's probe must refuse (imported through PYTHONPATH).
PROBE_REWARDS = '''
import time

def sleeps(prompts, responses):
    time.sleep(3600)
    return [0.0] * len(responses)

def one_score(prompts, responses):
    return [1.0]

def words(prompts, responses):
    return ["good"] * len(responses)

def broken(prompts, responses):
    raise KeyError("answer")

def non_finite(prompts, responses):
    return [float("nan") if i % 2 else float("inf") for i in range(len(responses))]

def needs_answer(prompts, responses, *, answer):
    return [1.0] * len(responses)
'''


def _tokenizers(inputs: Path) -> None:
    """tok_extra: the policy's tokenizer plus more tokens than the policy has embeddings;
    tok_other: a small tokenizer trained on other text (ids mean other words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from cluster.demo.tiny_models import build_tokenizer

    tok = AutoTokenizer.from_pretrained(build_tokenizer())
    tok.add_tokens([f"<extra_{i}>" for i in range(600)])
    tok.save_pretrained(inputs / "tok_extra")
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    other.train_from_iterator(["Lorem ipsum dolor sit amet, consectetur adipiscing elit."] * 20, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=other, eos_token="<eos>").save_pretrained(inputs / "tok_other")


def _two_label_reward_model(out: Path) -> None:
    """A sequence classifier with num_labels=2: a classifier, not a reward model."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    config = GPT2Config(vocab_size=1024, n_positions=64, n_embd=16, n_layer=1, n_head=2, num_labels=2,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    GPT2ForSequenceClassification(config).save_pretrained(out)


def _other_vocabulary_lm(out: Path) -> None:
    """A causal LM of 2048 ids: a teacher the tiny policy's tokenizer does not fit."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=2048, n_positions=64, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(out)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Everything the cases point at, built offline, outside any run.dir."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "bad.yaml").write_text("run: {steps: [1,\n")
    (d / "no_field.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                                              for i, t in enumerate(["The cat was", "A dog felt", "My friend"])))
    (d / "latin1.jsonl").write_bytes(b'{"prompt": "The cat was"}\n{"prompt": "The caf\xe9 was"}\n')
    (d / "empty.jsonl").write_text("\n\n")
    (d / "five.jsonl").write_text("".join(json.dumps({"prompt": f"The cat was {w}"}) + "\n"
                                          for w in ["calm", "happy", "sad", "kind", "bright"]))
    sft_rows = [{"prompt": "The cat was", "response": " calm."}, {"prompt": "A dog felt", "response": " sad."}] * 4
    (d / "with_response.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_rows))
    (d / "probe_rewards.py").write_text(PROBE_REWARDS)
    _tokenizers(d)
    _two_label_reward_model(d / "rm_two_labels")
    _other_vocabulary_lm(d / "lm_other_vocabulary")
    _old_runs(d)
    return d


def _old_runs(d: Path) -> None:
    """Run folders to resume from, as runs leave them: cut short, corrupted, made another way."""
    state = {"step": 2, "version": 2, "batches_issued": 2, "unfinished": [], "kl_beta": 0.05,
             "pinned": {"model.policy": "builtin:tiny-30m"}}
    for name in ("incomplete", "corrupt", "other_model", "finished", "no_learner", "scaled", "other_dtype",
                 "other_critic"):
        (d / name).mkdir()
        (d / name / "status.json").write_text(json.dumps({"state": "stopped"}))
    (d / "incomplete" / "checkpoints/resume/.step-000002.partial").mkdir(parents=True)  # a crash mid-write
    (d / "no_learner" / "checkpoints/resume/step-000002").mkdir(parents=True)  # learner state deleted by hand
    (d / "no_learner" / "checkpoints/resume/step-000002/state.json").write_text(json.dumps({**state, "pinned": {}}))
    for name, text in (("corrupt", '{"step": 2, "vers'), ("other_model", json.dumps(state)),
                       ("finished", json.dumps({**state, "step": 20, "pinned": {}})),
                       # trained in bf16; resumed with model.dtype=float32 below
                       ("other_dtype", json.dumps({**state, "pinned": {"learner.dtype": "bfloat16"}})),
                       # trained with a value head; resumed with a critic-free estimator below
                       ("other_critic", json.dumps({**state, "pinned": {"learner.critic": "shared"}})),
                       # cluster.scale grew the generators before the stop: the resume starts that many
                       ("scaled", json.dumps({**state, "pinned": {}, "pool_sizes": {"generator": 1000}}))):
        (d / name / "checkpoints/resume/step-000002").mkdir(parents=True)
        (d / name / "checkpoints/resume/step-000002/state.json").write_text(text)
        (d / name / "checkpoints/resume/step-000002/learner").mkdir()


WF = "function: 'cluster.demo.arithmetic:well_formed'"  # a reward.sources item's source


def _sources(*items: str) -> str:
    """reward.sources=[{...}, ...] of YAML mappings' insides, braces doubled (the cases are .format()ted)."""
    return "reward.sources=[" + ", ".join("{{" + item + "}}" for item in items) + "]"


CASES = [
    # -- the command line and the config file --
    pytest.param(["--config", "{inputs}/bad.yaml"], "bad.yaml is not valid YAML at line 2", id="yaml-malformed"),
    pytest.param(["--config", "{inputs}/missing.yaml"], "missing.yaml' not found; pass --config", id="config-missing"),
    pytest.param(["nonsense"], "override 'nonsense' must look like section.key=value", id="override-without-equals"),
    pytest.param(["ppo.kl.bta=1"], "unknown key ppo.kl.bta; did you mean ppo.kl.beta?", id="key-typo"),
    pytest.param(["run.beta=0.1"], "unknown key run.beta (beta is not a run key); did you mean ppo.kl.beta?",
                 id="key-in-wrong-section"),
    pytest.param(["ppo.replicas=2"], "(replicas is not a ppo key); did you mean generator.replicas, "
                 "reference.replicas, reward.replicas or learner.replicas?", id="pool-key-in-ppo"),
    pytest.param(["run.steps=many"], "run.steps must be int", id="wrong-type"),
    # -- impossible values and combinations --
    pytest.param(["run.steps=0"], "run.steps=0 must be >= 1", id="steps-zero"),
    pytest.param(["run.steps=-3"], "run.steps=-3 must be >= 1", id="steps-negative"),
    pytest.param(["run.mode=fast"], "run.mode='fast' is unknown; use one of sync, async", id="mode-unknown"),
    pytest.param(["run.name=../escape"], "run.name='../escape' must be a plain folder name", id="name-dotdot"),
    pytest.param(["run.name=a/b"], "run.name='a/b' must be a plain folder name", id="name-with-slash"),
    pytest.param(["ppo.kl.beta=-0.1"], "ppo.kl.beta=-0.1 must be >= 0", id="kl-beta-negative"),
    pytest.param(["ppo.kl.estimator=k9"], "ppo.kl.estimator='k9' is unknown; use one of k1, k2, k3",
                 id="kl-estimator-unknown"),
    pytest.param(["buffer.capacity=8"], "buffer.capacity=8 is below the 64 rollouts of one step",
                 id="buffer-below-one-step"),
    pytest.param(["learner.replicas=3", "data.prompts_per_step=2", "ppo.minibatch_size=6", "ppo.micro_batch_size=2"],
                 "data.prompts_per_step=2 is below learner.replicas=3: each learner rank trains on whole prompts",
                 id="fewer-prompts-than-learners"),
    pytest.param(["generator.sampling.max_new_tokens=200"],
                 "max_new_tokens=200 leaves no room for a prompt in generator.engine.max_model_len=128",
                 id="max-new-tokens-beyond-context"),
    pytest.param(["data.max_prompt_tokens=120"],
                 "data.max_prompt_tokens=120 + generator.sampling.max_new_tokens=16 exceed", id="prompt-plus-response"),
    pytest.param(["generator.sampling.top_p=1.5"], "config: generator.sampling.top_p must be in (0, 1] (got 1.5)",
                 id="top-p-above-1"),
    pytest.param(["generator.sampling.top_k=-5"], "top_k >= 0", id="top-k-negative"),
    pytest.param(["reward.gold=cluster.demo.sentiment:nothing"],
                 "reward.gold 'cluster.demo.sentiment:nothing': module 'cluster.demo.sentiment' has no callable",
                 id="gold-function-missing"),
    pytest.param(["ppo.off_policy=is"], "ppo.off_policy='is' is unknown; use one of none, tis, decoupled",
                 id="off-policy-unknown"),
    pytest.param(["ppo.is_cap=0.5"], "ppo.is_cap=0.5 must be a finite number >= 1", id="is-cap-below-1"),
    pytest.param(["ppo.off_policy=seq_mis", "ppo.rs_lower=2.0", "ppo.rs_upper=0.5"],
                 "ppo.rs_lower=2.0 and ppo.rs_upper=0.5 make no band: need 0 < rs_lower < rs_upper",
                 id="rejection-band-inverted"),
    pytest.param(["ppo.off_policy=seq_is"], "ppo.off_policy='seq_is' is unknown; use one of none, tis, decoupled, "
                 "seq_tis, seq_mis, geo_rs, geo_rs_token_tis, icepop", id="rollout-correction-preset-unknown"),
    pytest.param(["ppo.policy_loss=grpo"], "ppo.policy_loss='grpo' is unknown; use one of ppo, gspo, cispo",
                 id="policy-loss-unknown"),
    pytest.param(["ppo.policy_loss=gspo", "ppo.agg=token-mean"],
                 "ppo.policy_loss=gspo aggregates seq-mean-token-mean (its length normalisation)",
                 id="gspo-with-another-aggregation"),
    pytest.param(["ppo.ptx_coef=0.1", "ptx.batch_size=3", "learner.replicas=2"],
                 "ptx.batch_size=3 must be a positive multiple of learner.replicas=2", id="ptx-batch-not-divisible"),
    pytest.param(["ppo.ptx_coef=0.1", "ptx.path=/nonexistent/text.jsonl"],
                 "ptx.path: /nonexistent/text.jsonl does not exist", id="ptx-text-missing"),
    pytest.param(["ppo.ptx_coef=0.1", "ptx.path={inputs}/no_field.jsonl", "ptx.field=body"],
                 "ptx.field='body' is in none of the 3 rows", id="ptx-without-field"),
    pytest.param(["data.max_prompt_tokens=0"], "data.max_prompt_tokens=0 must be >= 1", id="max-prompt-tokens-zero"),
    pytest.param(["ppo.advantage=ppo"], "ppo.advantage='ppo' is unknown; use one of gae, grpo, rloo, reinforce_pp, "
                 "reinforce_pp_baseline", id="advantage-unknown"),
    pytest.param(["ppo.advantage=grpo", "generator.sampling.n=1", "data.prompts_per_step=32"],
                 "ppo.advantage=grpo compares each sample with the other samples of its prompt, but "
                 "generator.sampling.n=1; set generator.sampling.n >= 2", id="group-estimator-without-groups"),
    pytest.param(["ppo.advantage=rloo", "learner.critic=shared"],
                 "learner.critic=shared trains a value model that ppo.advantage=rloo never reads; set "
                 "learner.critic=none", id="critic-free-with-a-critic"),
    pytest.param(["learner.critic=none"], "learner.critic=none leaves ppo.advantage=gae without values",
                 id="gae-without-a-critic"),
    pytest.param(["ppo.filter_groups=true", "run.mode=async"],
                 "ppo.filter_groups refills a step with more prompt batches, which sync mode does",
                 id="dynamic-sampling-in-async-mode"),
    pytest.param(["ppo.filter_groups=true", "ppo.filter_max_batches=0"], "ppo.filter_max_batches=0 must be >= 1",
                 id="dynamic-sampling-no-batches"),
    pytest.param(["ppo.filter_groups=true", "buffer.capacity=100"],
                 "buffer.capacity=100 cannot hold a refilled step with ppo.filter_groups",
                 id="dynamic-sampling-buffer"),
    # -- data (prepare) --
    pytest.param(["data.path=/nonexistent/prompts.jsonl"], "data.path: /nonexistent/prompts.jsonl does not exist",
                 id="data-missing"),
    pytest.param(["data.path={inputs}/no_field.jsonl"],
                 "data.field='prompt' is in none of the 3 rows of {inputs}/no_field.jsonl", id="data-without-field"),
    pytest.param(["data.path={inputs}/latin1.jsonl"], "latin1.jsonl is not UTF-8 text (byte 0xe9 on line 2)",
                 id="data-not-utf8"),
    pytest.param(["data.path={inputs}/empty.jsonl"], "empty.jsonl holds no prompts", id="data-empty"),
    pytest.param(["data.path={inputs}/five.jsonl", "data.eval_prompts=0"],
                 "5 training prompts", id="data-fewer-than-a-step"),
    pytest.param(["data.chat_template=true"], "data.chat_template is true but the tokenizer", id="no-chat-template"),
    # -- models (prepare) --
    pytest.param(["model.policy=/nonexistent/model"], "does not exist", id="policy-missing"),
    pytest.param(["model.tokenizer={inputs}/tok_extra"], "tok_extra has 1077 tokens but model.policy=",
                 id="tokenizer-larger-than-policy"),
    pytest.param(["model.tokenizer={inputs}/tok_other"], "does not match the policy's vocabulary",
                 id="tokenizer-other-vocabulary"),
    pytest.param(["teacher.model={inputs}/lm_other_vocabulary"], "teacher.model='{inputs}/lm_other_vocabulary' has "
                 "vocab_size=2048 but the policy has 1024", id="teacher-vocabulary"),
    pytest.param(["teacher.model=/nonexistent/teacher"], "teacher.model='/nonexistent/teacher' does not exist",
                 id="teacher-missing"),
    pytest.param(["teacher.model=builtin:tiny", "teacher.coef=0"], "teacher.coef=0.0 must be a finite number > 0",
                 id="teacher-coef-zero"),
    pytest.param(["run.trackers=[tensorboard,wnadb]"], "run.trackers: 'wnadb' is unknown; use any of tensorboard, "
                 "wandb, mlflow", id="tracker-unknown"),
    # -- environment (prepare) --
    pytest.param(["env.environment=nowhere_env:Game"], "env.environment 'nowhere_env:Game': cannot import module",
                 id="env-missing"),
    pytest.param(["env.environment=os:getcwd"], "env.environment 'os:getcwd' is a builtin_function_or_method, not a "
                 "class", id="env-not-a-class"),
    pytest.param(["env.environment=actors.environments:MalformedToolCall"], "has no reset and no step method",
                 id="env-without-methods"),
    # -- reward (prepare) --
    pytest.param(["reward.function=no_such_module:score"], "cannot import module 'no_such_module'",
                 id="reward-module-unknown"),
    pytest.param(["reward.function=probe_rewards:one_score"], "returned 1 scores for 2 (prompt, response) pairs",
                 id="reward-wrong-count"),
    pytest.param(["reward.function=probe_rewards:words"], "returned str, not a list of numbers, for all 2 example",
                 id="reward-not-numbers"),
    pytest.param(["reward.function=probe_rewards:broken"], "raised on a probe", id="reward-raises"),
    pytest.param(["reward.function=probe_rewards:non_finite"], "reward.function 'probe_rewards:non_finite' returned "
                 "non-finite scores (inf, nan) for all 2 example (prompt, response) pairs", id="reward-non-finite"),
    pytest.param(["reward.gold=probe_rewards:non_finite"], "reward.gold 'probe_rewards:non_finite' returned non-finite",
                 id="gold-non-finite"),
    pytest.param(["reward.function=probe_rewards:sleeps", "reward.timeout_s=1"], "reward.function "
                 "'probe_rewards:sleeps' did not return within reward.timeout_s=1 s on a probe with 2 example "
                 "(prompt, response) pairs; make it return sooner, or raise reward.timeout_s", id="reward-sleeps"),
    pytest.param(["reward.gold=probe_rewards:sleeps", "reward.timeout_s=0.5"],
                 "reward.gold 'probe_rewards:sleeps' did not return within reward.timeout_s=0.5 s", id="gold-sleeps"),
    pytest.param(["reward.timeout_s=0"], "reward.timeout_s=0.0 must be > 0", id="reward-timeout-zero"),
    pytest.param(["reward.function=probe_rewards:needs_answer"], "reward.function 'probe_rewards:needs_answer' takes "
                 "the column 'answer' but the prompt rows have no such field", id="reward-column-not-in-data"),
    pytest.param(["reward.gold=probe_rewards:needs_answer"], "reward.gold 'probe_rewards:needs_answer' takes the "
                 "column 'answer'", id="gold-column-not-in-data"),
    pytest.param(["data.path={inputs}/no_field.jsonl", "data.field=text", "data.columns=[solution]"],
                 "data.columns names 'solution', which no row of", id="data-columns-not-in-data"),
    pytest.param(["reward.function=null", "reward.model=/nonexistent/rm"],
                 "reward.model='/nonexistent/rm' does not exist",
                 id="reward-model-missing"),
    pytest.param(["reward.function=null", "reward.model={inputs}/rm_two_labels"], "has num_labels=2",
                 id="reward-model-two-labels"),
    # -- reward.judge (config, then prepare) --
    pytest.param(["reward.function=null", "reward.judge.model=builtin:judge", "reward.judge.template=Rate {{prompt}} "
                  "by {{answer}}"], "reward.judge.template names the field 'answer', which the data does not have "
                 "(available: prompt, response)", id="judge-template-unknown-field"),
    pytest.param(["reward.function=null", "reward.judge.model=builtin:judge", "reward.judge.template=Rate {{prompt"],
                 "reward.judge.template is not a valid format string (expected '}}' before end of string)",
                 id="judge-template-bad-syntax"),
    pytest.param(["reward.judge.model=builtin:judge"], one_source_rule(), id="judge-and-function"),
    pytest.param(["reward.function=null", "reward.judge.model=/nonexistent/judge"],
                 "reward.judge.model='/nonexistent/judge' cannot be read (FileNotFoundError", id="judge-missing"),
    pytest.param(["reward.function=null", "reward.judge.model={inputs}/rm_two_labels"],
                 "ForSequenceClassification, not a causal LM", id="judge-not-a-causal-lm"),
    pytest.param(["reward.function=null", "reward.judge.model=builtin:nope"], "reward.judge.model='builtin:nope' is "
                 "not a built-in model", id="judge-builtin-unknown"),
    pytest.param(["reward.function=null", "reward.judge.model=builtin:judge", "reward.judge.choices={{A: 1}}",
                  "reward.judge.max_score=1"], "with choices, give each label its score instead",
                 id="judge-choices-with-bounds"),
    pytest.param(["reward.function=null", "reward.judge.model=builtin:judge", "data.path={inputs}/with_response.jsonl",
                  "data.prompts_per_step=8", "data.eval_prompts=0"], "the data has a column named 'response', which "
                 "reward.judge.template cannot tell from the response being scored", id="judge-data-column-response"),
    # -- reward.sources, reward.combine and group judges (config) --
    pytest.param(["reward.function=null", _sources(f"name: a, weight: 0, {WF}")],
                 "reward.sources has no trainable weight (every weight is 0: a are monitors only)",
                 id="sources-no-weight"),
    pytest.param(["reward.function=null", _sources(f"name: a, {WF}", f"name: a, {WF}")],
                 "reward.sources names 'a' twice", id="sources-duplicate-name"),
    pytest.param(["reward.function=null", _sources(f"name: a, {WF}, url: 'http://127.0.0.1:9/r'")],
                 "reward.sources[0] (a) must set exactly one of function, model, url, judge.model and environment: "
                 "true (got function, url)", id="sources-two-kinds"),
    pytest.param(["reward.function=null", _sources("name: a")], "reward.sources[0] (a) must set exactly one of "
                 "function, model, url, judge.model and environment: true (got none)", id="sources-no-kind"),
    pytest.param([_sources(f"name: a, {WF}")], "reward.sources replaces reward.model, reward.function, reward.url, "
                 "reward.judge.model; set reward.function=null", id="sources-and-single-key"),
    pytest.param(["reward.function=null", "reward.judge.model=builtin:judge", "reward.judge.mode=group",
                  "generator.sampling.n=1", "data.prompts_per_step=32"], "reward.judge.mode=group judges a prompt's "
                 "samples together, and generator.sampling.n=1 gives it one", id="group-judge-one-sample"),
    pytest.param(["reward.function=null", _sources(f"name: a, {WF}"), "reward.combine=gdpo", "generator.sampling.n=1",
                  "data.prompts_per_step=32"], "reward.combine=gdpo normalises each source within a prompt's group "
                 "of samples, and generator.sampling.n=1", id="gdpo-one-sample"),
    pytest.param(["reward.combine=mean"], "reward.combine='mean' is unknown; use one of sum, gdpo",
                 id="combine-unknown"),
    pytest.param(["reward.function=null", "reward.judge.model=builtin:judge", "reward.judge.chat_template=true"],
                 "the tokenizer of reward.judge.model='builtin:judge' has no chat template; set "
                 "reward.judge.chat_template=false", id="judge-chat-template-missing"),
    # -- resume --
    pytest.param(["run.resume={inputs}/no_such_run"], "no_such_run: not a run folder (no status.json)",
                 id="resume-missing-folder"),
    pytest.param(["run.resume={inputs}/incomplete"], "no complete checkpoint under", id="resume-incomplete-checkpoint"),
    pytest.param(["run.resume={inputs}/corrupt"], "step-000002 is unreadable (JSONDecodeError",
                 id="resume-corrupt-checkpoint"),
    pytest.param(["run.resume={inputs}/other_model"], "run.resume: model.policy='builtin:tiny' differs from the "
                 "checkpoint's 'builtin:tiny-30m'", id="resume-changed-model"),
    pytest.param(["run.resume={inputs}/other_dtype", "model.dtype=float32"],
                 "run.resume: learner.dtype='float32' differs from the checkpoint's 'bfloat16'",
                 id="resume-changed-precision"),
    pytest.param(["run.resume={inputs}/other_critic", "ppo.advantage=grpo"],
                 "run.resume: learner.critic='none' differs from the checkpoint's 'shared'",
                 id="resume-without-the-checkpoints-critic"),
    pytest.param(["run.resume={inputs}/finished", "run.steps=20"],
                 "already trained 20 steps of run.steps=20; raise run.steps",
                 id="resume-finished-run"),
    pytest.param(["run.resume=auto"], "run.resume=auto needs run.name", id="resume-auto-without-name"),
    pytest.param(["run.resume={inputs}/no_learner"], "step-000002 is incomplete (no learner/)",
                 id="resume-checkpoint-without-learner-state"),
    pytest.param(["run.checkpoint_every=-1"], "run.checkpoint_every must be >= 0", id="checkpoint-every-negative"),
    pytest.param(["run.resume={inputs}/scaled"], "pool generator: 1000 replicas",
                 id="resume-at-scaled-sizes-beyond-this-machine"),
    # -- a local Ray that cannot hold the pools: refused before it starts --
    pytest.param(["generator.replicas=1000"], "pool generator: 1000 replicas", id="pools-beyond-this-machine"),
    pytest.param(["generator.replicas=3", "resources.num_cpus=2"],
                 "pool generator: 3 replicas x 1 CPU bring the run to 6 CPUs, more than resources.num_cpus=2",
                 id="pools-beyond-local-num-cpus"),
    # -- the run folder itself --
    pytest.param(["run.dir=/proc/tether-runs"], "set run.dir to a writable directory", id="run-dir-unwritable"),
]


@pytest.mark.parametrize("args, message", CASES)
def test_user_mistake_exits_2_with_one_line(tmp_path, inputs, entrypoints, args, message):
    run_dir = tmp_path / "runs"
    args = [a.format(inputs=inputs) for a in args]
    result = entrypoints.run("cluster.train", [f"run.dir={run_dir}", *args],
                             env={"RAY_ADDRESS": "", "PYTHONPATH": str(inputs)})
    assert_one_line_error(result, run_dir, message.format(inputs=inputs))


# The same through a fresh interpreter, as a user types it: a config mistake, a data mistake
# found in prepare(), a reward function that raises inside the probe and one that never returns
# (its abandoned thread must not keep the interpreter from exiting).
REAL = {p.id: p for p in CASES if p.id in ("yaml-malformed", "data-not-utf8", "reward-raises", "reward-sleeps")}


@pytest.mark.parametrize("case", REAL)
def test_user_mistake_in_a_fresh_interpreter(tmp_path, inputs, case):
    (args, message), run_dir = REAL[case].values, tmp_path / "runs"
    env = {**os.environ, "RAY_ADDRESS": "", "PYTHONPATH": str(inputs)}
    result = subprocess.run([sys.executable, "-m", "cluster.train", f"run.dir={run_dir}",
                             *(a.format(inputs=inputs) for a in args)], cwd=REPO,
                            text=True, capture_output=True, timeout=300, env=env)
    assert_one_line_error(result, run_dir, message.format(inputs=inputs))


def test_uncaught_exception_in_a_forked_entrypoint_shows_its_traceback(entrypoints, tmp_path):
    """The server must not hide what a fresh interpreter would show: a crash is a traceback and
    exit 1, so the 'no Traceback' checks above could fail."""
    (tmp_path / "crash.py").write_text("raise KeyError('boom')\n")
    result = entrypoints.run("crash", [], env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1 and "Traceback" in result.stderr and "KeyError: 'boom'" in result.stderr


# A bug of tether's own, planted where a run prepares (before its folder) and where it runs
# (inside its folder): a plain ValueError from our code is a failure, never the user's mistake.
PLANTED_BUG = '''
import sys

import cluster.runtime.service as service

def bug(*args, **kwargs):
    raise ValueError("a bug of tether's")

setattr(service, sys.argv.pop(1), bug)
from cluster.train import main
sys.exit(main(sys.argv[1:]))
'''


def test_an_internal_value_error_in_a_run_exits_1_with_its_traceback_in_error_log(entrypoints, tmp_path):
    (tmp_path / "planted_bug.py").write_text(PLANTED_BUG)
    run_dir = tmp_path / "runs"
    result = entrypoints.run("planted_bug", ["connect_ray", f"run.dir={run_dir}", "run.name=bug"],
                             env={"RAY_ADDRESS": "", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tether: run failed: a bug of tether's (traceback in ") and "error:" not in last
    log = (run_dir / "bug" / "error.log").read_text()
    assert "Traceback" in log and "ValueError: a bug of tether's" in log and "in bug" in log
    assert json.loads((run_dir / "bug" / "status.json").read_text())["state"] == "failed"


def test_an_internal_value_error_while_preparing_exits_1_with_its_traceback(entrypoints, tmp_path):
    """Before the run folder exists: the traceback goes to stderr, as there is no error.log yet."""
    (tmp_path / "planted_bug.py").write_text(PLANTED_BUG)
    run_dir = tmp_path / "runs"
    result = entrypoints.run("planted_bug", ["prepare", f"run.dir={run_dir}"],
                             env={"RAY_ADDRESS": "", "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" in result.stderr and "tether: error:" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "tether: run failed: a bug of tether's (traceback above)"

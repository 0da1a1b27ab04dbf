"""TRL's side of bench.vs_trl: PPO steps of trl.experimental.ppo.PPOTrainer on the workload.

Runs in its own virtualenv (.bench-venv-trl, made by bench.vs_trl), so it imports nothing
of tether: it reads workload.json (bench/workload.py) and prints one JSON line per step:

    {"step": 1, "step_seconds": ..., "generate_seconds": ..., "score_seconds": ...,
     "learn_seconds": ..., "tokens": ..., "response_tokens_max": ...}

and a last line {"done": true, "startup_seconds": ..., "peak_rss_bytes": ...}.

Phases are timed by wrapping the trainer module's own helpers: `batch_generation`
(generate), the no-grad `forward` of the reference and `get_reward` of the value and
reward models (score); learn is the rest of the step (log-probs from the generation
scores, GAE, whitening, the PPO epochs).

--ragged (the workload's policy ends its responses at EOS): TRL stops at EOS (stop_token="eos"),
and pads with the tokenizer's own pad token, which that policy never samples.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

T0 = time.perf_counter()


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="trl_ppo_step.py")
    ap.add_argument("--workload", required=True, help="workload.json from bench/workload.py")
    ap.add_argument("--steps", type=int, required=True, help="PPO steps to run (warm-up included)")
    ap.add_argument("--prompts", type=int, required=True)
    ap.add_argument("--new-tokens", type=int, required=True)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16: fp32 weights under bf16 autocast (the trainer's bf16=True, plus generation "
                         "and scoring, which the trainer runs outside its autocast)")
    ap.add_argument("--ragged", action="store_true", help="stop each response at the policy's EOS")
    return ap.parse_args(argv)


class Phases:
    """Seconds spent inside wrapped functions, per step."""

    def __init__(self) -> None:
        self.seconds = {"generate": 0.0, "score": 0.0}

    def wrap(self, fn, phase, when=lambda: True):
        def timed(*args, **kwargs):
            if not when():
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
        return timed


def bench_tokenizer(path: str, vocab_size: int, ragged: bool = False):
    """The workload's tokenizer with a pad id the model cannot sample (``ragged``: its own, which the
    stopping policy never samples; a pad id past the vocabulary would be fed back to the model as
    the next token of a row that has stopped).

    TRL ends a response at its first pad token (and masks the rest); the policy may sample
    any of its `vocab_size` ids, pad included, which would cut some responses short on
    TRL's side only. Unused special tokens fill the gap to the vocabulary's end so the pad
    sentinel is id `vocab_size`; TRL replaces pad positions by id 0 before every forward.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if ragged:
        return tok
    fill = [f"<|bench-unused-{i}|>" for i in range(vocab_size - len(tok))]
    tok.add_special_tokens({"additional_special_tokens": fill})
    tok.add_special_tokens({"pad_token": "<|bench-pad|>"})
    assert tok.pad_token_id == vocab_size, (tok.pad_token_id, vocab_size)
    return tok


def load_models(wl: dict, tok):
    """(policy, reference, reward, value) from the workload's checkpoints, padding with ``tok``'s pad id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    load_lm = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    load_rm = lambda p: AutoModelForSequenceClassification.from_pretrained(p, dtype=torch.float32, num_labels=1)
    policy, ref = load_lm(wl["policy"]), load_lm(wl["reference"])
    reward, value = load_rm(wl["reward"]), load_rm(wl["value"])
    for m in (policy, ref, reward, value):
        m.config.pad_token_id = tok.pad_token_id
    policy.generation_config.pad_token_id = tok.pad_token_id
    return policy, ref, reward, value


def ppo_config(args, out_dir: str):
    """TRL's PPOConfig for the workload: the same hyperparameters as tether's side of the bench."""
    from trl.experimental.ppo import PPOConfig

    return PPOConfig(
        output_dir=out_dir, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, bf16=args.dtype == "bfloat16", fp16=False, seed=args.seed, data_seed=args.seed,
        # One rollout batch of `prompts`, cut into `minibatches` optimizer steps per epoch: TRL's
        # micro-batch is per_device_train_batch_size, and with gradient_accumulation_steps=1
        # every micro-batch is one optimizer step on local_batch_size / num_mini_batches rows.
        per_device_train_batch_size=args.prompts, gradient_accumulation_steps=1,
        num_mini_batches=args.minibatches, num_ppo_epochs=args.epochs,
        local_rollout_forward_batch_size=args.prompts, total_episodes=args.prompts * args.steps,
        response_length=args.new_tokens, stop_token_id=None,
        stop_token="eos" if args.ragged else None,  # fixed: no EOS stop, no truncation
        temperature=1.0, missing_eos_penalty=None, num_sample_generations=0,
        kl_coef=0.05, kl_estimator="k1", whiten_rewards=False, cliprange=0.2, cliprange_value=0.2,
        vf_coef=0.1, gamma=1.0, lam=0.95,
        learning_rate=1e-5, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        weight_decay=0.0, max_grad_norm=0.0,  # TRL's PPO loop never clips; 0 says so
        dataloader_num_workers=0)


def autocast(fn):
    """``fn`` under CPU bf16 autocast."""
    import torch

    def wrapped(*args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(*args, **kwargs)
    return wrapped


def instrument(trainer_module, bf16: bool = False) -> tuple[Phases, dict]:
    """Wrap the trainer module's helpers: (phase clock, the shapes of what it generated);
    ``bf16``: they run under bf16 autocast (nested in the trainer's own for the epochs)."""
    import torch

    if bf16:
        for name in ("batch_generation", "get_reward", "forward"):
            setattr(trainer_module, name, autocast(getattr(trainer_module, name)))
    phases = Phases()
    trainer_module.batch_generation = phases.wrap(trainer_module.batch_generation, "generate")
    trainer_module.get_reward = phases.wrap(trainer_module.get_reward, "score")
    # forward() serves the reference (no grad: scoring) and the PPO epochs (grad: learning).
    trainer_module.forward = phases.wrap(trainer_module.forward, "score", lambda: not torch.is_grad_enabled())
    shapes = {}
    trainer_module.batch_generation = _record_shape(trainer_module.batch_generation, shapes)
    return phases, shapes


def step_clock(phases: Phases, shapes: dict):
    """A TrainerCallback that prints the startup line, then one JSON line per step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t = time.perf_counter()
            print(json.dumps({"startup_seconds": self.t - T0}), flush=True)

        def on_step_end(self, args_, state, control, **k):
            now = time.perf_counter()
            step = now - self.t
            gen, score = phases.seconds["generate"], phases.seconds["score"]
            print(json.dumps({"step": state.global_step, "step_seconds": step, "generate_seconds": gen,
                              "score_seconds": score, "learn_seconds": step - gen - score,
                              "sync_seconds": 0.0, "tokens": shapes.get("tokens", 0),
                              "response_tokens_max": shapes.get("width", 0),
                              "eos_in_responses": shapes.get("eos", 0)}), flush=True)
            phases.seconds = {"generate": 0.0, "score": 0.0}
            self.t = time.perf_counter()

    return StepClock()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from datasets import Dataset
    from trl.experimental.ppo import PPOTrainer, ppo_trainer as trainer_module

    wl = json.loads(open(args.workload).read())
    torch.manual_seed(args.seed)
    tok = bench_tokenizer(wl["tokenizer"], wl["vocab_size"], args.ragged)
    dataset = Dataset.from_dict({"input_ids": wl["prompt_ids"]})
    policy, ref, reward, value = load_models(wl, tok)
    config = ppo_config(args, tempfile.mkdtemp(prefix="tether-bench-trl-"))
    phases, shapes = instrument(trainer_module, bf16=args.dtype == "bfloat16")
    trainer = PPOTrainer(args=config, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=dataset, eval_dataset=dataset.select(range(2)),
                         callbacks=[step_clock(phases, shapes)])
    shapes["eos_id"], shapes["pad_id"] = tok.eos_token_id, tok.pad_token_id
    trainer.train()
    print(json.dumps({"done": True, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "torch_threads": torch.get_num_threads()}), flush=True)
    return 0


def _record_shape(fn, shapes):
    """Count the response tokens TRL generated: through each row's EOS, where it stops (--ragged)."""
    def recorded(model, queries, *args, **kwargs):
        query_responses, logits = fn(model, queries, *args, **kwargs)
        responses = query_responses[:, queries.shape[1]:]
        shapes["width"] = int(responses.shape[1])
        shapes["tokens"] = int(responses.numel())
        shapes["eos"] = int((responses == shapes.get("eos_id", -1)).sum())
        shapes["tokens"] -= int((responses == shapes.get("pad_id", -1)).sum())  # rows that stopped early
        return query_responses, logits
    return recorded


if __name__ == "__main__":
    sys.exit(main())

"""The PPO job's checks on one step's rollouts: the minibatch, the buffer that holds them, the
prompt groups the estimators and dynamic sampling compare (``cfg``: a TetherConfig)."""
from __future__ import annotations

from core.choices import estimator_row
from core.infra.schema import ConfigError


def check_step(cfg) -> None:
    """A step's rollouts against the minibatch and the buffer that holds them."""
    check_lengths(cfg.generator, cfg.data.max_prompt_tokens)
    rollouts = cfg.rollouts_per_step
    if rollouts < cfg.ppo.minibatch_size:
        raise ConfigError(f"config: a step makes {rollouts} rollouts (data.prompts_per_step x "
                          f"generator.sampling.n) but ppo.minibatch_size={cfg.ppo.minibatch_size}; "
                          "lower the minibatch or raise prompts_per_step")
    n = cfg.generator.sampling.n
    if cfg.ppo.filter_groups:
        _check_filter(cfg)
    if estimator_row(cfg.ppo.advantage).uses_groups and n < 2:
        raise ConfigError(f"config: ppo.advantage={cfg.ppo.advantage} compares each sample with the other samples "
                          f"of its prompt, but generator.sampling.n={n}; set generator.sampling.n >= 2 "
                          "(4 to 16 is usual) or use ppo.advantage=reinforce_pp")
    if cfg.buffer.capacity < rollouts:
        raise ConfigError(f"config: buffer.capacity={cfg.buffer.capacity} is below the "
                          f"{rollouts} rollouts of one step; raise it")
    # Async: the learner waits for a step's rollouts while the producer waits for room to store
    # a whole chunk; with one generator a chunk is half a step's prompts (cluster/runtime/loop/dispatch.py).
    chunk = -(-cfg.data.prompts_per_step // 2) * cfg.generator.sampling.n
    if cfg.run.mode == "async" and cfg.buffer.capacity < rollouts + chunk - 1:
        raise ConfigError(f"config: buffer.capacity={cfg.buffer.capacity} can stall async mode: the learner "
                          f"waits for a step's {rollouts} rollouts while the producer waits for room for a "
                          f"chunk of up to {chunk}; raise it to at least {rollouts + chunk - 1}")


def _check_filter(cfg) -> None:
    if cfg.run.mode != "sync":
        raise ConfigError("config: ppo.filter_groups refills a step with more prompt batches, which sync mode "
                          "does; set run.mode=sync or ppo.filter_groups=false")
    if cfg.generator.sampling.n < 2:
        raise ConfigError(f"config: ppo.filter_groups compares the samples of each prompt, but "
                          f"generator.sampling.n={cfg.generator.sampling.n}; set generator.sampling.n >= 2")
    full = cfg.rollouts_per_step
    if cfg.buffer.capacity < 2 * full:
        raise ConfigError(f"config: buffer.capacity={cfg.buffer.capacity} cannot hold a refilled step with "
                          f"ppo.filter_groups (up to {2 * full - 1} rollouts: a batch short of {full}, plus one "
                          f"more batch); raise it to at least {2 * full}")
    if cfg.ppo.filter_max_batches < 1:
        raise ConfigError(f"config: ppo.filter_max_batches={cfg.ppo.filter_max_batches} must be >= 1 "
                          "(1: leave flat prompts out, draw nothing more)")


def check_lengths(gen, max_prompt_tokens) -> None:
    """Prompt and response share the engine's context: max_model_len must hold both."""
    new, room = gen.sampling.max_new_tokens, gen.engine.max_model_len
    if new >= room:
        raise ConfigError(f"config: generator.sampling.max_new_tokens={new} leaves no room for a prompt in "
                          f"generator.engine.max_model_len={room}; raise max_model_len or lower max_new_tokens")
    if max_prompt_tokens is not None and max_prompt_tokens + new > room:
        raise ConfigError(f"config: data.max_prompt_tokens={max_prompt_tokens} + generator.sampling.max_new_tokens="
                          f"{new} exceed generator.engine.max_model_len={room}; raise max_model_len or lower one "
                          "of them")

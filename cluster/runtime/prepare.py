"""Everything about a PPO job that can fail on user input, checked before any actor starts:
the models and their vocabularies, the reward, the prompts and the PTX corpus.

Each check refuses with a UserError; a call that reads the user's input through a library or a
lower layer (a tokenizer, a model's config, a dataset, a reward function) sits in
``user_input()``, which makes that call's ValueError or OSError the user's. Any other error here
is a bug of tether's (exit 1, its traceback)."""
from __future__ import annotations

import logging
from pathlib import Path

from cluster.job.errors import UserError
from cluster.runtime.state.models import resolve_model
from core.infra.errors import type_and_first_line, user_input
from core.modeling.architectures import check_policy_config, check_reward_config

log = logging.getLogger("tether")


def check_vocabulary(tokenizer, tokenizer_path: str, model_dir: str, key: str):
    """The model must have an embedding for every id the tokenizer makes; returns its config."""
    from transformers import AutoConfig

    with user_input():
        config = AutoConfig.from_pretrained(model_dir)
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size and len(tokenizer) > vocab_size:
        raise UserError(f"the tokenizer at {tokenizer_path} has {len(tokenizer)} tokens but {key}={model_dir!r} "
                        f"has vocab_size={vocab_size} (ids from {vocab_size} on have no embedding); set "
                        "model.tokenizer to the tokenizer the model was trained with")
    return config


def check_same_vocabulary(tokenizer, tokenizer_path: str, policy: str) -> None:
    """A model.tokenizer other than the policy's own must give every token of the policy's own
    tokenizer the same id (it may add tokens): otherwise ids mean other words, silently."""
    from transformers import AutoTokenizer

    own_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if Path(tokenizer_path).resolve() == Path(policy).resolve() or \
            not any((Path(policy) / f).exists() for f in own_files):
        return
    with user_input():
        own, given = AutoTokenizer.from_pretrained(policy).get_vocab(), tokenizer.get_vocab()
    moved = [t for t, i in own.items() if given.get(t) != i]
    if moved:
        t = moved[0]
        raise UserError(f"model.tokenizer={tokenizer_path!r} does not match the policy's vocabulary: {len(moved)} "
                        f"of the {len(own)} tokens of {policy}'s own tokenizer are missing or have other ids (e.g. "
                        f"{t!r}: {own[t]} vs {given.get(t)}); leave model.tokenizer null or use the policy's tokenizer")


def check_reward_model(path: str, tokenizer, tokenizer_path: str) -> None:
    """The reward model scores the policy's token ids with one output: check both from its config."""
    from core.modeling.loading import resolve_model_path

    try:
        path = resolve_model_path(path, "reward.model")
    except FileNotFoundError:
        raise UserError(f"reward.model={path!r} does not exist; point it at a sequence-classification model "
                        "directory, or set reward.model=null and name a reward.function") from None
    config = check_vocabulary(tokenizer, tokenizer_path, path, "reward.model")
    check_reward_config(config)
    if getattr(config, "num_labels", 1) != 1:
        raise UserError(f"reward.model={path!r} has num_labels={config.num_labels}; a reward model outputs one "
                        "score (num_labels=1): use a reward checkpoint, or a reward.function")




def check_judge(judge, columns) -> str:
    """The judge is a causal LM that exists, and its template names only fields the data has
    (prompt, response and the rows' ``columns``, none of them named prompt or response); returns
    its path."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from actors.rewards.group_judge import check_group_template
    from actors.rewards.judge import check_template
    from cluster.demo.judge import BUILTIN_JUDGE, judge_path
    from core.modeling.loading import resolve_model_path
    try:
        check_template(judge.template, columns)
        if judge.mode == "group":
            check_group_template(judge.group_template, columns)
    except ValueError as e:
        raise UserError(str(e)) from None
    if judge.model.startswith("builtin:") and judge.model != BUILTIN_JUDGE:
        raise UserError(f"reward.judge.model={judge.model!r} is not a built-in model; use {BUILTIN_JUDGE} "
                        "or a causal LM directory or Hub name")
    try:
        path = resolve_model_path(judge_path(judge.model), "reward.judge.model")
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a missing path, no config.json, a Hub name not in reach
        raise UserError(f"reward.judge.model={judge.model!r} cannot be read ({type_and_first_line(e)}); point it "
                        "at a causal LM directory or Hub name") from None
    arch = (getattr(config, "architectures", None) or ["no architecture"])[0]
    if arch != MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", "")):
        raise UserError(f"reward.judge.model={judge.model!r} is a {arch}, not a causal LM; a judge writes its "
                        "verdict: use a causal LM (e.g. an instruct model), or a classifier as reward.model")
    return path


# Example pairs for the reward probe: short, plain, what any reward should score.
PROBE_RESPONSES = (" It was a good day.", " No.")


def check_adapter_targets(learner, policy_config) -> None:
    """learner.lora's targets on the policy and, with lora.critic, on the critic's body."""
    from transformers import AutoConfig, AutoModel

    from learner.lora import check_targets

    check_targets(policy_config, learner.lora)
    if not learner.lora.critic:
        return
    from core.modeling.loading import resolve_model_path

    try:
        with user_input(kinds=(ValueError,)):  # a folder that is not a model: its one line
            path = resolve_model_path(learner.critic_model, "learner.critic_model")
    except FileNotFoundError:
        raise UserError(f"learner.critic_model={learner.critic_model!r} does not exist; point it at a "
                        "sequence-classification model directory (the reward model)") from None
    with user_input():
        critic_config = AutoConfig.from_pretrained(path)
    check_targets(critic_config, learner.lora, key="learner.critic_model", auto_class=AutoModel)


def prepare(cfg):
    """Everything that can fail on user input, before any actor starts."""
    from transformers import AutoTokenizer

    from actors.rewards.source import reward_parts, without_unused_reward

    cfg = without_unused_reward(cfg)  # env.reward=environment: the reward.* source is never called
    policy = resolve_model(cfg.model.policy)
    # Reward problems surface here, in the driver, not as a dead actor a minute later.
    from actors.rewards.scoring import ColumnBinding, load_function
    with user_input(kinds=(ValueError, OSError, ImportError)):  # the user's module, run on import
        functions = {key: load_function(spec, key) for key, spec in
                     (("reward.function", cfg.reward.function), ("reward.gold", cfg.reward.gold),
                      *((f"reward.sources[{i}].function", s.function) for i, s in enumerate(cfg.reward.sources)))
                     if spec}
        required = {c for fn in functions.values() for c in ColumnBinding.of(fn).required}
    tokenizer_path = cfg.model.tokenizer or policy
    with user_input():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    check_same_vocabulary(tokenizer, tokenizer_path, policy)
    policy_config = check_vocabulary(tokenizer, tokenizer_path, policy, "model.policy")
    check_policy_config(policy_config)
    if cfg.learner.lora.enabled:
        check_adapter_targets(cfg.learner, policy_config)
    if cfg.reference.model:
        from cluster.runtime.state.lineage import check_reference
        with user_input():
            check_reference(cfg.reference.model, tokenizer, tokenizer_path, policy)
    train_set, eval_set = prepare_prompts(cfg.data, tokenizer_path, required)
    parts = reward_parts(cfg.reward) if cfg.reward.sources else ()
    for reward in (cfg.reward, *(p.config for p in parts)):  # the single keys, then each of reward.sources alike
        probe_source(reward, tokenizer, tokenizer_path, train_set)
    if cfg.env.agent:
        probe_agent(cfg.env)
    elif cfg.env.enabled:
        probe_environment(cfg.env, train_set, tokenizer)
    return policy, tokenizer_path, tokenizer, train_set, eval_set


def resolve_data(path):
    """data.path as the loader reads it: builtin:arith the arithmetic task's rows, written once
    into the cache; null (the built-in prompts), a file, a folder or a Hub id as given."""
    from cluster.demo import arithmetic

    if path == arithmetic.BUILTIN:
        return str(arithmetic.build_prompt_file())
    if path is not None and path.startswith("builtin:"):
        raise UserError(f"data.path={path!r} is not a built-in prompt set; use {arithmetic.BUILTIN}, null (the "
                        "built-in prompts), a .jsonl/.parquet file, a saved dataset folder or a Hub dataset id")
    return path


def prepare_prompts(d, tokenizer_path: str, required_columns: set[str]):
    """(train, eval) prompt sets of the data section ``d``; rows lacking a column in
    ``required_columns`` (what the reward functions require) are skipped and counted."""
    from cluster.data.prompts import PromptDataset

    with user_input():
        dataset = PromptDataset.load(path=resolve_data(d.path), field=d.field, tokenizer_path=tokenizer_path,
                                     chat_template=d.chat_template, max_prompt_tokens=d.max_prompt_tokens,
                                     seed=d.seed, split=d.split, config_name=d.config_name, columns=d.columns,
                                     required_columns=required_columns, system_prompt=d.system_prompt)
    if dataset.num_skipped:
        log.warning("data: skipped %d rows %s, e.g. %s", dataset.num_skipped, dataset.skip_counts,
                    dataset.skipped[0])
    train_set, eval_set = dataset.split_eval(d.eval_prompts)
    if len(train_set) < d.prompts_per_step:  # else the first step fails, after the run folder exists
        raise UserError(f"data: {len(train_set)} training prompts in {dataset.source} (after holding out "
                        f"data.eval_prompts={d.eval_prompts}) are fewer than data.prompts_per_step="
                        f"{d.prompts_per_step}; lower prompts_per_step or eval_prompts, or add prompts")
    return train_set, eval_set


def probe_reward(reward, train_set) -> None:
    """Score example pairs of the first training prompts (with their columns) as the replicas
    will: a reward function, gold function or server that cannot would void every batch (or
    eval), so it is refused here in one line."""
    from actors.rewards.probe import probe_function

    prompts = train_set.texts[:len(PROBE_RESPONSES)]
    responses = list(PROBE_RESPONSES[:len(prompts)])
    columns = train_set.columns.take(train_set.ids[:len(prompts)])  # the first rows' own fields
    for key, spec in (("reward.function", reward.function), ("reward.gold", reward.gold)):
        if spec:
            with user_input():  # the user's function, scoring
                probe_function(spec, prompts, responses, key, reward.timeout_s, columns=columns,
                               sandbox=reward.sandbox)
    if reward.url:
        from actors.rewards.http import probe_server
        with user_input():  # the user's server, answering
            probe_server(reward.url, prompts, responses, columns=columns, settings=reward.http)


def probe_source(reward, tokenizer, tokenizer_path: str, train_set) -> None:
    """A reward section (the run's, or one of reward.sources as a RewardConfig holding it alone)
    checked and probed: a reward model's config, a judge's template and input, a function or a
    server called on example pairs."""
    if reward.model:
        check_reward_model(reward.model, tokenizer, tokenizer_path)
        if reward.normalize:  # the actors would fail on it one by one: refuse here, in one line
            from actors.rewards.reward_model import load_reward_stats
            with user_input():
                load_reward_stats(reward.model)
    if reward.judge.model:
        probe_judge(reward.judge, check_judge(reward.judge, train_set.columns.names), train_set)
    probe_reward(reward, train_set)


def probe_judge(judge, path: str, train_set) -> None:
    """Fill reward.judge.template with example pairs of the first training prompts (with their
    columns) and tokenize them as the judge replicas will (actors/rewards/judge.py), with the judge's
    tokenizer at ``path``: a template the rows cannot fill, a chat template the tokenizer lacks or
    cannot render, an input that cannot fit the engine, or a choice label the judge cannot write
    in max_new_tokens would void every batch, so each is refused here in one line."""
    from transformers import AutoTokenizer

    from actors.rewards.judge import judge_token_ids, render

    prompts = train_set.texts[:len(PROBE_RESPONSES)]
    columns = train_set.columns.take(train_set.ids[:len(prompts)])
    try:
        texts = render(judge.template, prompts, list(PROBE_RESPONSES[:len(prompts)]), columns)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:
        raise UserError(f"reward.judge.template cannot be filled from the first training prompts' columns "
                        f"({type(e).__name__}: {e}); fix the template or the data") from None
    with user_input():
        tokenizer = AutoTokenizer.from_pretrained(path)
    if judge.chat_template and not tokenizer.chat_template:
        raise UserError(f"reward.judge.chat_template=true but the tokenizer of reward.judge.model={judge.model!r} has "
                        "no chat template; set reward.judge.chat_template=false (the filled template is then the "
                        "judge's whole input) or use an instruct judge")
    try:
        ids = [judge_token_ids(tokenizer, t, judge.chat_template) for t in texts]
    except Exception as e:  # noqa: BLE001 - the judge's own chat template raising (raise_exception, a bad key)
        raise UserError(f"reward.judge.chat_template=true but the chat template of reward.judge.model={judge.model!r} "
                        f"cannot render the filled template as a user turn ({type_and_first_line(e)})") from None
    room = judge.engine.max_model_len - judge.max_new_tokens
    if max(map(len, ids)) > room:
        raise UserError(f"reward.judge: the first training prompts with a short example response fill the judge's "
                        f"input to {max(map(len, ids))} tokens, more than the {room} that reward.judge.engine."
                        f"max_model_len={judge.engine.max_model_len} leaves beside max_new_tokens="
                        f"{judge.max_new_tokens}; raise max_model_len or shorten the template")
    check_labels(judge, tokenizer)


def check_labels(judge, tokenizer) -> None:
    """Each reward.judge.choices label fits in max_new_tokens tokens of the judge's ``tokenizer``
    (the shorter of its tokenizations alone and after a space): else no verdict can hold it."""
    for label in judge.choices or ():
        n = min(len(tokenizer(x, add_special_tokens=False)["input_ids"]) for x in (label, " " + label))
        if n > judge.max_new_tokens:
            raise UserError(f"reward.judge.choices label {label!r} takes {n} tokens of the judge's tokenizer, more "
                            f"than reward.judge.max_new_tokens={judge.max_new_tokens}: the judge could never write "
                            "it; raise max_new_tokens or shorten the label")


def probe_agent(env) -> None:
    """Import the agent in a worker, as a generator will, and look up env.tool_parser: an agent that
    cannot be imported (or is not a function), or a parser vLLM does not have, is refused here in
    one line, before any actor starts."""
    from actors.gateway.agents import AgentWorkers
    from actors.gateway.tool_calls import check_parser

    try:
        if env.tool_parser is not None:
            check_parser(env.tool_parser)
        AgentWorkers(env.agent, workers=1, episode_timeout_s=env.episode_timeout_s, memory_mb=env.memory_mb).close()
    except ValueError as e:
        raise UserError(str(e)) from None


def probe_environment(env, train_set, tokenizer) -> None:
    """Start the environment in a worker and reset it on the first training prompt, with its
    columns, as a generator will, and render an observation with the policy's ``tokenizer``: a
    class that cannot be imported or reset, or a chat template that cannot append observations
    as exact ids, is refused here in one line, before any actor starts."""
    from actors.environments.transcript import ObservationTokens
    from actors.environments.workers import EnvironmentWorkers

    try:
        observations = ObservationTokens(tokenizer, role=env.observation_role, plain_format=env.plain_format,
                                         name="the policy's tokenizer")
    except ValueError as e:
        raise UserError(f"env.environment: {e} (env.observation_role={env.observation_role!r})") from None

    try:
        workers = EnvironmentWorkers(env.environment, key="env.environment", workers=1,
                                     step_timeout_s=env.step_timeout_s, memory_mb=env.memory_mb)
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        first = workers.call({0: ("reset", train_set.texts[0], train_set.columns.row(train_set.ids[0]))})[0]
    finally:
        workers.close()
    if not first.ok:
        raise UserError(f"env.environment {env.environment!r} failed on the first training prompt: {first.error}")
    if first.result is not None:  # a first observation: it must follow the prompt as exact ids
        try:
            observations.after_prompt(list(train_set.prompt_ids[0]), first.result)
        except ValueError as e:
            raise UserError(f"env.environment {env.environment!r}: its reset returned a first observation, but {e}") \
                from None


def prepare_ptx(cfg, tokenizer_path: str):
    """The packed PTX rows when ppo.ptx_coef > 0 (cluster/data/ptx.py), else None."""
    p = cfg.ptx
    if cfg.ppo.ptx_coef == 0:
        if p.path is not None:
            log.warning("ptx.path is set but ppo.ptx_coef=0: the PTX loss is off (set ppo.ptx_coef > 0 to use it)")
        return None
    from cluster.data.ptx import PTXData
    with user_input():
        ptx = PTXData.load(path=p.path, field=p.field, tokenizer_path=tokenizer_path,
                           seq_len=p.tokens_per_row(cfg.generator.engine.max_model_len),
                           builtin_policy=cfg.model.policy.startswith("builtin:"), seed=cfg.run.seed,
                           split=p.split, config_name=p.config_name)
    log.info("ptx: %d rows of %d tokens from %s, %d per optimizer step, coefficient %g", len(ptx),
             ptx.rows.shape[1], ptx.source, p.batch_size, cfg.ppo.ptx_coef)
    return ptx

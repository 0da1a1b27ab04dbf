"""The reward's typed sections: reward (its source and how a replica scores), reward.http (a
reward server's requests, actors/rewards/http.py), reward.sandbox (a function scored in worker
processes, actors/rewards/sandbox.py) and reward.judge (a judge model, actors/rewards/judge.py).
A reward replica is built from these objects. Plain dataclasses: a run's config is built and
checked without torch or vLLM."""
from __future__ import annotations

import re
import string
from typing import Literal, Optional
from urllib.parse import urlsplit

from actors.rewards.combine import COMBINERS
from core.infra.schema import ConfigError, config_class, setting
from core.modeling.engine_config import EngineConfig

JudgeMode = Literal["pair", "group"]
Combine = Literal[tuple(COMBINERS)]  # the combiners' table names the choices (actors/rewards/combine.py)


@config_class
class RewardHTTPConfig:
    """A reward server (reward.url): batching, concurrency, time limits and retries of its requests."""
    batch_size: int = setting(64, "(prompt, response) pairs per request")
    concurrency: int = setting(4, "requests in flight at once per scoring call (one call per chunk per replica)")
    timeout_s: float = setting(30.0, "one request not answered within this many seconds is retried")
    retries: int = setting(3, "retries of a request after a connection error, a timeout or a 5xx/429 reply, "
                              "waiting backoff_s, then twice that, ...; a 4xx or a malformed reply is not retried")
    backoff_s: float = setting(0.5, "the wait before the first retry; it doubles with each")
    budget_s: float = setting(120.0, "all requests of one scoring call, retries included, end within this many "
                                     "seconds; pairs still unscored by then are invalid")
    label_field: Optional[str] = setting("answer", "the prompt rows' column sent as the request's 'labels' (null "
                                                   "where a row has no value; \"\" per pair when the data has no "
                                                   "such column or this is null, as OpenRLHF without --label_key)")
    skip_special_tokens: bool = setting(False, "false: 'query' is the pair's prompt + response ids decoded at once "
                                               "with special tokens kept (the end-of-turn token included), as "
                                               "OpenRLHF sends it; true: plain text, every field without special "
                                               "tokens and the query the prompt's text + the response's")


def check_reward_http(url: Optional[str], http: RewardHTTPConfig) -> None:
    """One line naming the key and the fix for a URL or settings no request could honour."""
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"config: reward.url={url!r} is not an http(s) URL; give the reward server's "
                              "endpoint, e.g. http://127.0.0.1:5000/get_reward")
    if http.batch_size < 1 or http.concurrency < 1 or http.retries < 0:
        raise ConfigError(f"config: reward.http.batch_size={http.batch_size} and concurrency={http.concurrency} "
                          f"must be >= 1 and retries={http.retries} >= 0")
    if not (http.timeout_s > 0 and http.budget_s > 0 and http.backoff_s >= 0):
        raise ConfigError(f"config: reward.http.timeout_s={http.timeout_s} and budget_s={http.budget_s} must be "
                          f"> 0 and backoff_s={http.backoff_s} >= 0 (seconds)")


@config_class
class SandboxConfig:
    """Run reward.function and reward.gold in worker processes: a pair that hangs, crashes or eats memory is invalid"""
    workers: int = setting(0, "worker processes per reward replica, each scoring one pair at a time; 0 = off "
                              "(the function runs in the replica, limited by reward.timeout_s per call)")
    timeout_s: float = setting(10.0, "a pair not scored after this many seconds is invalid; its worker is killed "
                                     "and replaced")
    memory_mb: int = setting(0, "cap on each worker's data segment (heap and anonymous memory, RLIMIT_DATA; the "
                                "interpreter and the function's imports count too), in MiB: past it an allocation "
                                "fails and that pair is invalid; 0 = no cap")


def check_sandbox(sandbox: SandboxConfig) -> None:
    """One line naming the key, for settings no sandbox can run with."""
    if sandbox.workers < 0 or not sandbox.timeout_s > 0 or sandbox.memory_mb < 0:
        raise ConfigError(f"config: reward.sandbox.workers={sandbox.workers} must be >= 0 (0 = off), "
                          f"reward.sandbox.timeout_s={sandbox.timeout_s} > 0 and reward.sandbox.memory_mb="
                          f"{sandbox.memory_mb} >= 0 (0 = no cap)")


def template_fields(template: str, key: str = "reward.judge.template") -> set[str]:
    """The field names a ``str.format`` template uses (``{answer[0]}`` uses ``answer``); a
    one-line ValueError for bad format syntax or a positional field (``{}``, ``{0}``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{key} is not a valid format string ({e}); write fields as {{prompt}}, "
                         "{response} or {column}, and a literal brace as {{ or }}") from None
    names = set()
    for _, name, _, _ in parsed:
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ValueError(f"{key} has a positional field {{{name}}}; name it: {{prompt}}, {{response}} "
                             "or a column of the data")
        names.add(root)
    return names


# The built-in tiny judge's prompt (cluster/demo/judge.py trains on this very text).
DEFAULT_TEMPLATE = "Prompt: {prompt}\nResponse: {response}\nScore:"
# reward.judge.mode=group's prompt: {responses} is the group's responses enumerated ("Response 1: ...").
GROUP_TEMPLATE = ("Prompt: {prompt}\n\n{responses}\n\nScore each of the {n} responses from 0 to 10. Answer with "
                  "one line per response, as 'Response k: score'.\nScores:")


@config_class
class JudgeConfig:
    """A judge model scoring each response: its vLLM engine, its prompt and how its verdict is read."""
    model: Optional[str] = setting(None, "the judge: a causal LM directory or Hub name, or builtin:judge (the "
                                         "offline tiny judge); null = no judge")
    template: str = setting(DEFAULT_TEMPLATE, "the judge's prompt, a Python format string: {prompt}, {response} "
                                              "and any column of the data ({answer}; a column named prompt or "
                                              "response is refused: rename it); a literal brace is {{ or }}")
    chat_template: bool = setting(False, "wrap the filled template as the user turn of the judge tokenizer's "
                                         "chat template (instruct judges)")
    choices: Optional[dict[str, float]] = setting(None, "read the verdict as the first of these labels in the "
                                                        "output, scored as given ({A: 1.0, B: 0.0}); null = the "
                                                        "first number in the output")
    min_score: Optional[float] = setting(None, "number verdicts below this are raised to it; null = no bound")
    max_score: Optional[float] = setting(None, "number verdicts above this are lowered to it; null = no bound")
    max_new_tokens: int = setting(8, "tokens the judge may write per verdict")
    temperature: float = setting(0.0, "0 = greedy: the same pair always gets the same verdict")
    mode: JudgeMode = setting("pair", "pair: one judge call per (prompt, response) | group: one call per prompt sees "
                                      "all generator.sampling.n responses of its group (group_template) and answers "
                                      "n scores; a reply without exactly n readable scores voids the whole group")
    group_template: str = setting(GROUP_TEMPLATE, "with mode=group: the judge's prompt, a format string: {prompt}, "
                                                  "{responses} (the group's responses, 'Response 1: ...' each, a "
                                                  "blank line between), {n} (their number) and any column")
    engine: EngineConfig

    def __post_init__(self) -> None:
        template_fields(self.template)  # its syntax; its fields are checked against the data's columns
        template_fields(self.group_template, "reward.judge.group_template")
        if self.max_new_tokens < 1 or self.temperature < 0:
            raise ValueError("reward.judge.max_new_tokens must be >= 1 and reward.judge.temperature >= 0")
        if self.choices is not None and (not self.choices or "" in self.choices):
            raise ValueError("reward.judge.choices needs at least one non-empty label, e.g. {A: 1.0, B: 0.0}; "
                             "or null to read a number")
        if self.choices and self.mode == "group":
            raise ValueError("reward.judge.mode=group reads one number per response; choices (labels) are read in "
                             "mode=pair only: remove choices or set mode=pair")
        if self.choices and (self.min_score is not None or self.max_score is not None):
            raise ValueError("reward.judge.min_score/max_score bound number verdicts; with choices, give each "
                             "label its score instead")
        if None not in (self.min_score, self.max_score) and self.min_score > self.max_score:
            raise ValueError(f"reward.judge.min_score={self.min_score} is above max_score={self.max_score}")
        if self.max_new_tokens >= self.engine.max_model_len:
            raise ValueError(f"reward.judge.max_new_tokens={self.max_new_tokens} leaves no room for the template in "
                             f"reward.judge.engine.max_model_len={self.engine.max_model_len}")


BUILTIN_REWARD = "cluster.demo.sentiment:sentiment"


@config_class
class ScorerSettings:
    """What one reward source is and how a replica scores with it: the keys reward and each of reward.sources share."""
    model: Optional[str] = setting(None, "sequence-classification reward model directory, or ...")
    function: Optional[str] = setting(None, "... a `module:function(prompts, responses) -> floats`, or ...")
    url: Optional[str] = setting(None, "... a reward server's http(s) URL, POSTed OpenRLHF's remote reward "
                                       "payload ({query, prompts, labels} -> {rewards}; docs/guide/rewards.md)")
    batch_size: int = setting(16, "sequences per forward pass of the reward model")
    packing: bool = setting(True, "the reward model's forwards as one row of their sequences' real tokens, no "
                                  "padding, attended per sequence")
    normalize: bool = setting(False, "standardise reward-model scores with the reward_stats.json beside "
                                     "reward.model")
    timeout_s: float = setting(60.0, "a reward.function or reward.gold call that has not returned after this "
                                     "many seconds counts its pairs as invalid scores (the call is abandoned; "
                                     "the start-up probe refuses such a function)")
    http: RewardHTTPConfig
    sandbox: SandboxConfig
    judge: JudgeConfig


def scorer_settings(section) -> dict:
    """The ScorerSettings keys of ``section`` (a RewardConfig or a RewardSourceConfig), by name."""
    from dataclasses import fields

    return {f.name: getattr(section, f.name) for f in fields(ScorerSettings)}


@config_class
class RewardSourceConfig(ScorerSettings):
    """One of reward.sources: a named, weighted source with the single-source keys of its own."""
    name: str = setting("", "the source's name (letters, digits, _ and -): its step metric is reward/<name>/mean")
    weight: float = setting(1.0, "its weight in the pair's score; 0 = a monitor, scored and logged, never "
                                 "trained on")
    environment: bool = setting(False, "the episodes' own score (env.environment or env.agent, with "
                                       "env.reward=pool) as this source, instead of function/model/url/judge.model")


@config_class
class RewardConfig(ScorerSettings):
    """The reward: a reward model, a Python function, a server over HTTP or a judge model scoring each response."""
    function: Optional[str] = setting(BUILTIN_REWARD, "... a `module:function(prompts, responses) -> floats`, or ...")
    gold: Optional[str] = setting(None, "eval only: a `module:function(prompts, responses) -> floats` scored on "
                                        "the held-out prompts as eval/gold_score, never trained on (the true "
                                        "goal behind a proxy)")
    max_invalid_fraction: float = setting(0.5, "a step whose share of invalid scores (NaN/inf, or the reward "
                                               "raised) is above this stops the run, naming the reward; "
                                               "1 = never")
    sources: tuple[RewardSourceConfig, ...] = setting((), "several sources scored together, each {name, weight, and "
                                                          "the single-source keys: function, model, url, judge, "
                                                          "sandbox, http, ... or environment: true}; the pair's score "
                                                          "combines theirs (combine). Replaces reward.function/model/"
                                                          "url/judge.model (set those to null); [] = one source")
    combine: Combine = setting("sum", "with sources: sum = the weighted sum of the sources' scores | gdpo = each "
                                      "source's scores normalised within the prompt's group (mean, std over its "
                                      "samples), then the weighted sum (GDPO)")

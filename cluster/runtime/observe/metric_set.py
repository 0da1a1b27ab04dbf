"""The metric set: every exported metric's key, Prometheus name, meaning and tag keys.

The one place the metric set is defined (cluster.runtime.observe.metrics exports it); tests check
docs/metrics.md and docs/grafana/tether-dashboard.json against ``METRICS``.
"""
from __future__ import annotations

import re

PREFIX = "tether_"
REPLICA_TAGS = ("pool", "replica")

# key -> one-line meaning.
MEANINGS: dict[str, str] = {
    "reward/mean": "mean sequence score of the step's rollouts (reward model or function)",
    "reward/std": "standard deviation of the sequence scores in the step",
    "kl/mean": "mean per-sequence KL(behaviour || reference), summed over response tokens",
    "kl/beta": "KL penalty coefficient used for this step (fixed or adaptive controller)",
    "ppo/policy_loss": "clipped PPO policy loss, mean over minibatch updates",
    "ppo/value_loss": "clipped value loss, mean over minibatch updates",
    "ppo/ptx_loss": "pretraining (PTX) language-model loss, when ptx_coef > 0",
    "ppo/kl_loss": "KL-to-reference loss term before beta, mean over minibatch updates (ppo.kl.placement=loss)",
    "ppo/kl_loss_token_mean": "token-mean of the KL estimator in the loss (ppo.kl.placement=loss)",
    "ppo/kl_loss_coef": "beta the learner weighed the KL loss term with this step (ppo.kl.placement=loss)",
    "ppo/entropy": "token-mean entropy of the tempered policy on its own samples",
    "ppo/clip_frac": "fraction of tokens whose probability ratio was clipped",
    "ppo/approx_kl": "token-mean KL between the policy before and after the update",
    "ppo/vf_clip_frac": "fraction of tokens whose value prediction was clipped",
    "ppo/explained_variance": "1 - Var(returns - values) / Var(returns); 1 is perfect, <0 worse than a constant",
    "ppo/grad_norm": "gradient norm before clipping, mean over optimiser steps",
    "ppo/lr": "learning rate at the end of the step",
    "ppo/logprob_gap_mean": "token-mean |vLLM behaviour logprob - learner logprob| (same weights)",
    "ppo/logprob_gap_max": "largest |vLLM behaviour logprob - learner logprob| in the batch",
    "ppo/returns_mean": "token-mean GAE return",
    "ppo/values_mean": "token-mean value prediction",
    "advantage/abs_mean": "critic-free estimators: token-mean |advantage| over the batch",
    "advantage/zero_frac": "critic-free estimators: fraction of tokens with a zero advantage (a prompt whose "
                           "samples' returns are all equal teaches nothing)",
    "teacher/kl_mean": "token-mean of log pi_old - log pi_teacher over the sampled tokens: KL(policy || teacher), "
                       "the distillation term before teacher.coef (teacher.model)",
    "teacher/logprob_mean": "token-mean log-prob the teacher gives the sampled tokens (teacher.model)",
    "eval/gold_score": "mean reward.gold score on the held-out prompts (evaluation only, never trained on)",
    "alarm/proxy_up_gold_down": "1 when eval/score_mean rose and eval/gold_score fell over the last 3 evaluations",
    "alarm/kl_up_entropy_down":
        "1 when KL to the reference climbed while entropy collapsed over run.alarm_window steps",
    "alarm/length_drift": "1 when the response length moved > 50% from its first window's mean",
    "off_policy/behaviour_kl": "token-mean KL(behaviour || learner at the update's start), k3 estimate",
    "off_policy/is_weight_mean": "token-mean importance weight pi_learner / pi_behaviour, before the cap",
    "off_policy/is_weight_max": "largest importance weight pi_learner / pi_behaviour in the batch",
    "off_policy/capped_frac": "fraction of tokens whose weight exceeds ppo.is_cap (tis truncates, decoupled drops)",
    "off_policy/truncated_frac": "fraction of tokens whose ppo.off_policy weight was cut down to ppo.is_cap (a "
                                 "sequence preset counts every token of a truncated row)",
    "off_policy/masked_frac": "fraction of tokens the ppo.off_policy preset rejected: weight 0 (decoupled, and "
                              "the masking presets seq_mis, geo_rs, geo_rs_token_tis, icepop)",
    "perf/step_seconds": "wall time of the whole PPO step",
    "perf/generate_seconds": "time spent generating rollouts",
    "perf/score_seconds": "time spent on reference logprobs and reward scores",
    "perf/learn_seconds": "time spent in the learner group (PPO epochs)",
    "perf/sync_seconds": "time to broadcast weights learner -> generators",
    "perf/sync_wait_seconds":
        "part of the sync a generator waited for its engine (a generate call,"
        " or with partial rollouts one engine step)",
    "perf/tokens_per_s": "generated response tokens per second over all generators",
    "perf/buffer_wait_seconds": "time the learner side waited on the RolloutBuffer",
    "perf/admission_wait_seconds": "async: time the producer waited before issuing a batch that could not yet be "
                                   "trained within buffer.max_staleness (admission by version)",
    "perf/sync_bytes": "bytes the weight sync sends learner -> generators (with learner.lora: the adapter's files)",
    "perf/learner_seconds": "time of one learner rank's train() call",
    "perf/learner_group_seconds": "time of the learner group's train(), sharding included",
    "perf/learner_tokens_per_s": "response tokens per second through the learner",
    "perf/learner_padding_frac": "fraction of the positions the update's forwards ran on that were padding "
                                 "(0 with ppo.packing)",
    "perf/startup_seconds": "process start to a run ready to step (step 0 only)",
    **{f"perf/startup_{phase}_seconds": f"start-up phase: {meaning} (step 0 only)" for phase, meaning in (
        ("imports", "interpreter and imports"), ("prepare", "models, tokenizer and data checked"),
        ("ray", "Ray connected or started"), ("pools", "engines and learner ranks loaded"),
        ("other", "run folder and control actor"))},
    "transfer/cross_node_bytes": "bytes of rollout-side objects pulled from another node in the step, all hops",
    "transfer/cross_node_seconds": "seconds of the pulls that fetched objects from other nodes' stores, summed",
    "transfer/to_scorers_bytes": "cross-node bytes of rollouts pulled by reference and reward replicas",
    "transfer/to_buffer_bytes": "cross-node bytes of rollouts, reference log-probs and scores pulled by the buffer",
    "transfer/to_learner_bytes": "cross-node bytes of the learner shards pulled by the learner ranks",
    "generator/tokens_per_s": "generated tokens per second of one generator replica",
    "score/seconds": "latency of one scoring call, per pool (reference | reward) and replica",
    "reward/http_seconds": "reward.url: seconds the reward replicas' scoring calls to the server took in the step, "
                           "summed over calls (retries and waits included)",
    "reward/http_requests": "reward.url: requests sent to the reward server in the step, retries included",
    "reward/http_retries": "reward.url: requests sent again after a connection error, a timeout or a 5xx/429 reply",
    "buffer/depth": "scored rollouts waiting in the RolloutBuffer",
    "buffer/dropped_stale": "rollouts dropped so far for exceeding max_staleness",
    "buffer/staleness_mean": "mean policy-version lag of rollouts handed to the learner",
    "buffer/staleness_max": "largest policy-version lag handed to the learner",
    "buffer/token_staleness_mean":
        "mean policy-version lag of the tokens handed to the learner (each token's own version)",
    "rollouts/partial_frac":
        "fraction of the batch's rollouts sampled by two or more policy versions (partial rollouts)",
    "response/length_mean": "mean response length in tokens of the step's rollouts",
    "response/truncated_frac": "fraction of responses cut at max length",
    "rollouts/used": "scored rollouts in the step's learner batch",
    "rollouts/prompts": "prompts sent to the generators for the step",
    "rollouts/skipped_prompts": "prompts skipped (too long, empty after templating)",
    "rollouts/invalid_scores": "rollouts dropped because the reward was invalid (NaN, error)",
    "reward/timeouts": "of the invalid scores, pairs whose reward call passed its time limit (reward.timeout_s, or "
                       "reward.sandbox.timeout_s per pair)",
    "reward/crashes": "of the invalid scores, pairs whose reward.sandbox worker died scoring them (exit, signal, "
                      "OOM kill)",
    "rollouts/empty_responses": "rollouts with an empty response",
    "rollouts/incomplete_kept_sets": "sampled positions whose top-k kept set may hold more tokens (ties at the "
                                     "k-th logit) than the generator read",
    "rollouts/duplicate_chunks": "prompt chunks the buffer had stored already (a redispatch that raced its original)",
    "rollouts/redispatched_chunks": "prompt chunks sent again because the replica holding them died",
    "rollouts/filtered_frac": "dynamic sampling (ppo.filter_groups): share of the step's sampled prompts left out "
                              "because their samples all scored the same",
    "rollouts/extra_generated": "dynamic sampling: rollouts of the extra prompt batches drawn to refill the step",
    "rollouts/surplus": "dynamic sampling: rollouts of whole prompt groups held beyond the step's batch after a "
                        "refill, left out untrained",
    "eval/score_mean": "mean score on the held-out eval prompts (eval steps only)",
    "eval/response_len": "mean eval response length in tokens (eval steps only)",
    "episode/turns_mean": "env.environment: the policy's turns per episode, mean over the step's episodes",
    "episode/env_tokens_frac": "env.environment: share of the transcripts' response tokens the environment wrote "
                               "(observations: context, never trained)",
    "episode/invalid": "env.environment: episodes that ended invalid (an environment error, timeout, crash, "
                       "malformed action or lost worker); their scores are invalid",
    "env/steps": "env.environment: environment step calls this step (one per answered policy turn)",
    "env/step_seconds": "env.environment: seconds the generators waited on their environments (resets, steps, "
                        "closes), summed over generators",
    "env/errors": "env.environment: requests whose environment code raised or returned something invalid",
    "env/timeouts": "env.environment: requests that passed env.step_timeout_s (the worker was killed and replaced)",
    "env/crashes": "env.environment: requests whose environment worker died (exit, signal, env.memory_mb)",
    "env/malformed_actions": "env.environment: turns the environment could not read (MalformedAction, e.g. a "
                             "tool call that does not parse)",
    "env/lost": "env.environment: episodes lost with a worker that another episode's request killed",
    "env/tool_calls": "env.environment: tool calls made, summed over episodes (the info['tool_calls'] an "
                      "environment reports at an episode's last step)",
    "env/tool_errors": "env.environment: tool calls that raised (info['tool_errors'] at an episode's last step)",
    "agent/sessions": "env.agent: episodes played (one gateway session each) this step",
    "agent/calls_per_session": "env.agent: the agent's calls to the policy per episode, mean over the step",
    "agent/invalid": "env.agent: episodes that ended invalid (the agent raised, returned no valid score, timed out "
                     "or its worker died); their scores are invalid",
    "agent/errors": "env.agent: episodes whose agent raised or returned something other than a finite score or None",
    "agent/timeouts": "env.agent: episodes that passed env.episode_timeout_s (the worker was killed and replaced)",
    "agent/crashes": "env.agent: episodes whose agent worker died (exit, signal, env.memory_mb)",
    "agent/retokenize_mismatch": "env.agent: calls whose history, as the agent sent it back, rendered to other ids "
                                 "than the policy sampled; the sampled ids were kept in its place",
    "agent/rewritten": "env.agent: calls whose history did not continue the session's transcript (rewritten, "
                       "e.g. summarised): each starts a rollout of its own with the episode's score",
    "agent/without_calls": "env.agent: episodes whose agent never called the policy (no rollout: nothing to train)",
    "agent/replayed": "env.agent: episodes played again from the start because the gateway restarted under them",
    "gateway/prefix_cache_hit_rate": "env.agent: share of the agents' calls' prompt tokens the generators' prefix "
                                     "caches held (a session's calls go to one replica, which keeps its history)",
    "policy/version": "policy version the generators run",
    "pool/generator_replicas": "live generator replicas (cluster.scale changes it while the job runs)",
    "pool/reference_replicas": "live reference replicas",
    "pool/reward_replicas": "live reward replicas",
    "data/batches_issued":
        "prompt batches drawn from the data stream so far (its position; a resume continues from it)",
    "learner/step": "learner updates done",
    "learner/optimizer_steps": "optimiser steps done (DeepSpeed global_steps)",
    "learner/tokens": "response tokens in the last learner batch",
}
# Keys exported per replica; every other metric has no tag.
TAGGED: dict[str, tuple[str, ...]] = {"generator/tokens_per_s": REPLICA_TAGS, "score/seconds": REPLICA_TAGS}


def metric_name(key: str) -> str:
    """``ppo/clip_frac`` -> ``tether_ppo_clip_frac`` (Prometheus-safe)."""
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key).lower()


METRICS: dict[str, str] = {metric_name(k): meaning for k, meaning in MEANINGS.items()}
# reward/<source>/mean and reward/<source>/count: one series per value of data.source_field in the data,
# and reward/<name>/mean per reward.sources source.
PER_SOURCE = re.compile(r"tether_reward_.+_(mean|count)")
PER_SOURCE_MEANING = ("the step's reward over the rollouts of one data source (data.source_field), or one "
                      "reward.sources source's mean score over the rollouts trained on")
TAG_KEYS: dict[str, tuple[str, ...]] = {metric_name(k): TAGGED.get(k, ()) for k in MEANINGS}

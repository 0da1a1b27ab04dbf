"""A step that the reward scores mostly as invalid stops the run, naming the reward.

An invalid score (NaN or inf, or a reward call that raised) leaves its rollout out of
training and is counted in rollouts/invalid_scores: a few are how a reward says "no score
for this one". Most of a step means the reward is broken, and the run would go on training
on what is left. So above ``reward.max_invalid_fraction`` of a step's scored rollouts the
run stops with one line naming the reward (exit 2, as the other mistakes the user fixes;
the start-up probe refuses a reward function that scores nothing finite before any of this).
With ``env.reward: environment`` the scores are the episodes' own, and an invalid one is an
episode its environment failed: the line names the environment and how its episodes failed.
"""
from __future__ import annotations

from actors.rewards.source import reward_source
from core.infra.errors import InputError


class InvalidScores(InputError):
    """Too many of a step's scores were invalid: the user's to fix (cluster.train exits 2)."""


def check_invalid_scores(produced, cfg, step: int) -> None:
    """Raise InvalidScores if ``produced`` (cluster.runtime.observe.produced.Produced, what fed step
    ``step``) has more invalid scores than ``cfg.reward.max_invalid_fraction`` allows."""
    limit = cfg.reward.max_invalid_fraction
    scored = produced.stored + produced.invalid_scores + produced.empty_responses
    if not scored or produced.invalid_scores <= limit * scored:
        return
    source, failed = reward_source(cfg), episode_failures(produced.episode_counts, cfg.env)
    above = f"above reward.max_invalid_fraction={limit:g}"
    rest = "raise reward.max_invalid_fraction to train on the rest"
    if source.from_episodes:
        raise_time = f", raise {episode_timeout(cfg.env)[0]}" if "timed out" in failed else ""
        fix = f"fix the {source.type.label}{raise_time}"
        raise InvalidScores(f"{source.name}: {produced.invalid_scores} of {scored} episodes at step {step} were "
                            f"invalid ({failed or 'the environment failed them'}; the log's 'reward:' lines say "
                            f"why), {above}; {fix}, or {rest}")
    episodes = f"; {failed} in {cfg.env.player_key} {cfg.env.player}" if failed else ""
    raise InvalidScores(f"{source.name}: {produced.invalid_scores} of {scored} scores at step {step} were invalid "
                        f"(NaN or inf, or the reward raised; the log's 'reward:' lines say why{episodes}), {above}; "
                        f"fix the reward, or {rest}")


# The episode counts (actors/environments/episodes.py's episode_counts, with the workers' faults) that end an
# episode invalid, and how the message says them.
_FAILURES = (("timeouts", "timed out past {key}={timeout:g} s"),
             ("lost", "lost with a worker that failed another episode"),
             ("crashes", "had their worker process die"),
             ("errors", "had the {who} raise or return no valid score"),
             ("malformed_actions", "had an action the environment could not read"))


def episode_timeout(env) -> tuple[str, float]:
    """The key and value of the time an episode's step (an environment's) or whole run (an agent's) has."""
    return ("env.episode_timeout_s", env.episode_timeout_s) if env.agent else ("env.step_timeout_s", env.step_timeout_s)


def episode_failures(counts: dict, env) -> str:
    """How a step's episodes failed, from their summed counts: "3 timed out past
    env.step_timeout_s=10 s, 5 lost with ..." ('' when none did)."""
    if not counts.get("invalid"):
        return ""
    (timeout_key, timeout), who = episode_timeout(env), "agent" if env.agent else "environment"
    parts = [f"{counts[key]} {what.format(key=timeout_key, timeout=timeout, who=who)}"
             for key, what in _FAILURES if counts.get(key)]
    return f"{counts['invalid']} episodes failed: " + ", ".join(parts) if parts else \
        f"{counts['invalid']} episodes failed"

"""The episode loop's ends (actors/environments/episodes.py) with a scripted sampler and the real environment
workers: done, max_turns, the token budget (the transcript still ends on a policy token), and
an environment that hangs or raises, which ends that episode invalid and no other."""

import os
import threading

import numpy as np
import pytest

from actors.environments.continuous import ContinuousEpisodes
from actors.environments.episodes import EpisodeRunner, Turn
from actors.environments.transcript import ObservationTokens
from actors.environments.workers import EnvironmentWorkers

pytestmark = pytest.mark.integration
ACTIONS = {7: "go", 8: "hang", 9: "raise"}  # a turn's first id says what the Counter is told


class Tokens:
    """A stand-in tokenizer for observations: one id per character (no chat template)."""
    eos_token_id, chat_template = 2, None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [100 + ord(c) % 100 for c in text]}


def scripted(first_ids):
    """Every turn is 3 tokens: the prompt index's action id, then 5, 2 (room permitting)."""
    def sample(transcripts, room, keys):
        return [Turn([first_ids[p], 5, 2][:r], np.full(min(3, r), -1.0, np.float32))
                for (p, _, _), r in zip(keys, room)]
    return sample


def admitted(first_ids):
    """``scripted`` as an engine admits turns: each answered later, from another thread."""
    sample = scripted(first_ids)

    def admit(transcript, room, key, then):
        (turn,) = sample([transcript], [room], [key])
        threading.Thread(target=then, args=(turn,)).start()
    return admit


SCHEDULES = {"rounds": (EpisodeRunner, scripted), "continuous": (ContinuousEpisodes, admitted)}


@pytest.fixture(params=sorted(SCHEDULES))
def schedule(request):
    return request.param


def runner(workers, max_turns=5, max_tokens=200, turn_tokens=3, schedule="rounds"):
    return SCHEDULES[schedule][0](workers=workers, observations=ObservationTokens(Tokens()),
                                  decode=lambda ids: ACTIONS[ids[0]], max_turns=max_turns, max_tokens=max_tokens,
                                  max_turn_tokens=turn_tokens)


def run(first_ids, *, max_turns=5, max_tokens=200, columns=None, turn_tokens=3, schedule="rounds"):
    workers = EnvironmentWorkers("counter_envs:Counter", workers=2, step_timeout_s=1.0)
    try:
        prompts = [([1, 2, 3], i, "silent", (columns or {})) for i in range(len(first_ids))]
        episodes = runner(workers, max_turns, max_tokens, turn_tokens, schedule).run(
            prompts, 1, SCHEDULES[schedule][1](first_ids))
        return episodes, workers.stats()
    finally:
        workers.close()


def test_the_environment_ends_the_episode_with_its_reward(schedule):
    (ep,), _ = run([7], schedule=schedule)
    assert (ep.turns, ep.finish_reason, ep.score, ep.error) == (3, "stop", 1.0, None)
    assert ep.mask == [True] * 3 + [False] * 6 + [True] * 3 + [False] * 6 + [True] * 3  # "\nok 1\n" is 6 ids
    assert ep.rollout(version=4).trained_tokens == 9 and ep.logprobs[3:9] == [0.0] * 6


# max_turns and a budget that leaves no room for the next observation end the episode after a turn
# that ended (finish_reason "stop"); only a turn cut before its end-of-turn id truncates ("length").
@pytest.mark.parametrize("kw, turns, finish", [(dict(max_turns=2), 2, "stop"), (dict(max_tokens=14), 2, "stop"),
                                               (dict(max_tokens=11), 2, "length")])
def test_budgets_end_the_episode_on_a_policy_token(kw, turns, finish, schedule):
    (ep,), _ = run([7], **kw, schedule=schedule)
    assert ep.turns == turns and ep.finish_reason == finish and ep.mask[-1] and ep.error is None
    assert len(ep.response) <= kw.get("max_tokens", 200)


@pytest.mark.parametrize("max_tokens", [22, 21])
def test_a_turn_ending_exactly_at_the_budget_is_answered(max_tokens, schedule):
    """Three turns of 3 ids and two observations of 6 take 21 ids: the third turn's end-of-turn id
    lands on the budget at 21, and the environment still answers it (its reward, done)."""
    (ep,), _ = run([7], max_tokens=max_tokens, schedule=schedule)
    assert (ep.turns, len(ep.response), ep.score, ep.finish_reason) == (3, 21, 1.0, "stop")


def test_a_turn_cut_before_its_end_of_turn_ends_the_episode_unanswered(schedule):
    (ep,), stats = run([7], turn_tokens=2, schedule=schedule)  # [7, 5]: the end-of-turn id 2 did not fit
    assert (ep.turns, ep.finish_reason, ep.response, ep.error, ep.score) == (1, "length", [7, 5], None, 0.0)


def test_an_environment_that_hangs_or_raises_ends_its_episode_only(schedule):
    (go, hang, boom), stats = run([7, 8, 9], schedule=schedule)
    assert go.error is None and go.score == 1.0
    assert "did not answer within env.step_timeout_s=1 s" in hang.error and np.isnan(hang.score)
    assert "Counter.step raised RuntimeError: the game broke" in boom.error
    assert stats["timeouts"] == 1 and stats["errors"] == 1 and stats["env_workers"] == 2


class Silent:
    """Columns and a tokenizer for ``play``: every prompt decodes to "silent" (no first observation)."""
    def row(self, index):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return "silent"


def test_play_counts_what_its_episodes_did(schedule):
    workers = EnvironmentWorkers("counter_envs:Counter", workers=2, step_timeout_s=1.0)
    try:
        rollouts, counts = runner(workers, schedule=schedule).play(
            [([1, 2, 3], 0), ([1, 2, 3], 2)], Silent(), Silent(), 2, SCHEDULES[schedule][1]([7, 0, 9]), version=3)
    finally:
        workers.close()
    assert [r.env_error is None for r in rollouts] == [True, True, False, False]
    # two episodes of three turns (9 policy, 12 observation tokens); two that raised at their first step
    assert {k: counts[k] for k in ("episodes", "invalid", "turns", "policy_tokens", "env_tokens", "steps",
                                   "errors", "timeouts", "malformed_actions")} == \
        dict(episodes=4, invalid=2, turns=8, policy_tokens=24, env_tokens=24, steps=8, errors=2, timeouts=0,
             malformed_actions=0)
    assert counts["step_seconds"] > 0 and counts["tool_calls"] == 0


@pytest.mark.parametrize("schedule, waited", [("continuous", True), ("rounds", False)])
def test_a_turn_waits_for_its_own_environment_only_when_continuous(tmp_path, schedule, waited):
    """Episode "wait"'s first step holds until episode "go" has taken two more turns: played
    continuously, go's turns and steps go on meanwhile and both end; in rounds, go's next turn
    waits for the round that wait's step holds, which runs out of env.step_timeout_s."""
    marker = str(tmp_path / "go-took-its-turns")
    os.mkfifo(marker)
    workers = EnvironmentWorkers("counter_envs:Relay", workers=2, step_timeout_s=30.0 if waited else 2.0)
    try:
        prompts = [([1, 2, 3], i, "silent", {"role": role, "marker": marker, "after": 3})
                   for i, role in enumerate(["wait", "go"])]
        wait, go = runner(workers, schedule=schedule).run(prompts, 1, SCHEDULES[schedule][1]([7, 7]))
    finally:
        workers.close()
    assert go.error is None and (go.turns, go.score) == (3, 1.0)
    if waited:
        assert wait.error is None and (wait.turns, wait.score) == (3, 1.0)
    else:
        assert "did not answer within env.step_timeout_s=2 s" in wait.error


def test_an_engine_error_fails_the_continuous_call_once_every_admitted_turn_is_back():
    """The engine failing one turn fails the call with that error, after the turns already
    admitted have come back (none is left calling into a finished call)."""
    sample, back = admitted([7, 7, 7]), []

    def admit(transcript, room, key, then):
        if key == (1, 0, 1):  # the second prompt's second turn
            threading.Thread(target=then, args=(RuntimeError("the engine broke"),)).start()
            return
        sample(transcript, room, key, lambda turn: (back.append(key), then(turn)))

    workers = EnvironmentWorkers("counter_envs:Counter", workers=2, step_timeout_s=5.0)
    try:
        prompts = [([1, 2, 3], i, "silent", {}) for i in range(3)]
        with pytest.raises(RuntimeError, match="the engine broke"):
            runner(workers, schedule="continuous").run(prompts, 1, admit)
        assert workers.pending == 0 and len(back) >= 3
    finally:
        workers.close()

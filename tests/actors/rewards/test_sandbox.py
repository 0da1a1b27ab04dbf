"""A reward function in the sandbox's worker processes (actors/rewards/sandbox.py): a pair that hangs, crashes,
eats memory, raises or returns no number is invalid on its own; the other pairs of its call score,
the scorer serves on with the same number of workers, and close() reaps them."""
import sys
import threading
import types

import numpy as np
import pytest
from reward_configs import reward_config

from actors.reward import Reward
from actors.rewards.config import SandboxConfig
from actors.rewards.probe import probe_function
from actors.rewards.sandbox import SandboxScorer

pytestmark = pytest.mark.integration

MISBEHAVES = "sandbox_verifiers:misbehaves"
SANDBOX = {"workers": 2, "timeout_s": 1.0, "memory_mb": 1024}
BOX = SandboxConfig(**SANDBOX)


def _scorer(**kw) -> SandboxScorer:
    settings = {**SANDBOX, **kw}
    return SandboxScorer(MISBEHAVES, name=f"reward function {MISBEHAVES}", key="reward.function",
                         workers=settings["workers"], timeout_s=settings["timeout_s"],
                         memory_mb=settings["memory_mb"])


@pytest.fixture(scope="module")
def scorer():
    s = _scorer()
    yield s
    s.close()


BAD = {  # response -> what the pair's error line says
    "hang": "did not return within reward.sandbox.timeout_s=1 s (its worker was killed)",
    "exit": "its worker process exited with status 1",
    "segv": "its worker process killed by SIGSEGV",
    "sigkill": "its worker process killed by SIGKILL",
    "hog": "ran out of memory (reward.sandbox.memory_mb=1024)",
    "pyhog": "ran out of memory (reward.sandbox.memory_mb=1024)",
    "raise": "raised RuntimeError: verifier broke",
    "none": "returned NoneType instead of a number",
    "string": "returned str instead of a number",
    "two": "returned 2 scores for 1 pair",
    "exit0": "raised SystemExit: 0",
}


def test_each_misbehaving_pair_is_invalid_and_the_rest_of_the_batch_scores(scorer):
    threads = threading.active_count()
    responses = ["ok"] + [r for bad in BAD for r in (bad, "x" * (len(bad) + 1))]
    res = scorer.score_texts(["p"] * len(responses), responses, {})
    pairs_of = {}  # what an error line says -> the indices of the pairs it covers
    for i, r in enumerate(responses):
        if r in BAD:
            assert not res.valid[i] and np.isnan(res.scores[i]), r
            pairs_of.setdefault(BAD[r], []).append(i)
        else:
            assert res.valid[i] and res.scores[i] == len(r), r
    # One line per reason, counting its pairs and naming the first (both memory hogs share one).
    assert len(res.errors) == len(pairs_of), res.errors
    for says, ix in pairs_of.items():
        [line] = [e for e in res.errors if says in e]
        assert f" on {len(ix)} of {len(responses)} pairs (first at index {ix[0]})" in line, (line, ix)
    assert res.counts["timeouts"] == 1 and res.counts["crashes"] == 3 and not res.failed
    assert all("\n" not in e and e.endswith("those pairs are invalid") for e in res.errors)
    assert scorer.workers == SANDBOX["workers"] and threading.active_count() == threads  # replaced; no thread left
    again = scorer.score_texts(["p", "p"], ["fine", "hang"], {})  # it serves on
    assert again.valid.tolist() == [True, False] and again.scores[0] == 4.0 and again.counts["timeouts"] == 1
    assert scorer.stats()["timeouts"] == 2 and scorer.stats()["crashes"] == 3


def test_columns_reach_the_function_one_value_per_pair():
    s = SandboxScorer("sandbox_verifiers:with_answer", name="f", key="reward.function", workers=1, timeout_s=30)
    try:
        res = s.score_texts(["p"] * 3, ["4", "5", "6"], {"answer": [4, 7, "6"], "unused": [0, 0, 0]})
    finally:
        s.close()
    assert res.scores.tolist() == [1.0, 0.0, 1.0]


def test_close_reaps_every_worker():
    s = _scorer(workers=3)
    s.score_texts(["p"], ["hang"], {})  # one replaced worker among them
    procs = [w.proc for w in s._pool.slots]
    s.close()
    assert s.workers == 0 and all(p.poll() is not None for p in procs)


def test_a_function_not_importable_in_a_fresh_process_is_refused_at_start_in_one_line():
    """Defined in this process only (as in a notebook): the workers cannot import it; the probe says so."""
    only_here = types.ModuleType("only_in_this_process")
    only_here.f = lambda prompts, responses: [1.0] * len(responses)
    sys.modules["only_in_this_process"] = only_here
    try:
        probe_function("only_in_this_process:f", ["p"], ["r"], timeout_s=5)  # fine in this process
        with pytest.raises(ValueError) as e:
            probe_function("only_in_this_process:f", ["p"], ["r"], timeout_s=5, sandbox=BOX)
    finally:
        del sys.modules["only_in_this_process"]
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward.function 'only_in_this_process:f': cannot import module "
                                              "'only_in_this_process'"), msg


def test_the_probe_runs_in_the_sandbox_and_refuses_a_function_with_no_valid_pair():
    with pytest.raises(ValueError) as e:
        probe_function(MISBEHAVES, ["p", "q"], ["hang", "segv"], timeout_s=60, sandbox=BOX)
    assert str(e.value).startswith(f"reward.function '{MISBEHAVES}' scored none of 2 example (prompt, response) "
                                   "pairs on a probe in reward.sandbox: ")
    probe_function(MISBEHAVES, ["p", "q"], ["hang", "fine"], timeout_s=60, sandbox=BOX)  # one valid: passes


def test_a_memory_cap_too_small_to_import_the_function_is_one_line():
    with pytest.raises(ValueError) as e:  # sympy does not fit in 64 MiB beside the interpreter
        SandboxScorer("actors.rewards:math", name="f", key="reward.function", workers=1, timeout_s=30, memory_mb=64)
    assert "\n" not in str(e.value) and "reward.sandbox.memory_mb=64" in str(e.value) and "raise it" in str(e.value)


def _encode(tokenizer, texts):
    return [np.array(tokenizer(t)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def ray_with_verifiers():
    """The shared Ray (tests/rays.py), whose workers import tests/actors/sandbox_verifiers.py."""
    import ray
    import rays

    rays.shared()
    return ray


def test_a_reward_replica_as_a_ray_actor_scores_through_a_hang_and_a_crash(policy_path, tokenizer,
                                                                          ray_with_verifiers):
    ray = ray_with_verifiers
    actor = ray.remote(Reward).remote(config=reward_config(function=MISBEHAVES, sandbox=SANDBOX), tokenizer=policy_path)
    prompts = _encode(tokenizer, ["Once"] * 4)
    for _ in range(2):
        res = ray.get(actor.score.remote(prompts, _encode(tokenizer, ["a cat", "hang", "segv", "a dog"])))
        assert res.valid.tolist() == [True, False, False, True] and res.scores[0] == 5.0
        assert res.counts["timeouts"] == 1 and res.counts["crashes"] == 1
    health = ray.get(actor.health.remote())
    assert health["timeouts"] == 2 and health["crashes"] == 2 and health["invalid_items"] == 4
    ray.get(actor.close.remote())
    ray.kill(actor)

"""Environments in worker processes (actors/environments/workers.py): an episode whose environment hangs,
crashes, raises or returns something invalid ends invalid with one line, the others on other
workers go on, a killed worker's other episodes are reported lost, and the pool serves on."""

import pytest

from actors.environments.base import Step, check_step, load_environment
from actors.environments.workers import EnvironmentWorkers

COUNTER = "counter_envs:Counter"


@pytest.fixture
def pool():
    p = EnvironmentWorkers(COUNTER, workers=2, step_timeout_s=1.0)
    yield p
    p.close()


@pytest.mark.unit
@pytest.mark.parametrize("out, says", [
    (("o", 1.0, True), "a tuple of 3"), ("o", "returned str"), (("o", float("inf"), True, {}), "reward inf"),
    ((3, None, False, {}), "observation of type int"), (("o", None, "yes", {}), "done='yes'"),
    (("o", None, False, []), "info of type list"), (("o", True, False, {}), "reward True")])
def test_a_step_return_that_is_not_valid_is_one_line(out, says):
    with pytest.raises(ValueError, match="env step") as e:
        check_step(out, "env step")
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.unit
def test_a_valid_step_is_checked_into_a_step():
    assert check_step(("o", 2, 1, None), "s") == Step("o", 2.0, True, {})
    assert check_step((None, None, False, {"k": 1}), "s") == Step(None, None, False, {"k": 1})


@pytest.mark.unit
@pytest.mark.parametrize("spec, says", [("counter_envs:NoStep", "has no step method"),
                                        ("counter_envs:missing", "has no callable 'missing'"),
                                        ("nowhere_module:Env", "cannot import module"),
                                        ("os:getcwd", "not a class")])
def test_a_bad_environment_spec_is_one_line(spec, says):
    with pytest.raises(ValueError) as e:
        load_environment(spec)
    assert says in str(e.value) and "env.class" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.integration
def test_episodes_run_in_the_workers_each_with_its_own_instance(pool):
    out = pool.call({0: ("reset", "p", {"start": 0}), 1: ("reset", "silent", {}), 2: ("reset", "p", {"start": 10})})
    assert [out[i].result for i in range(3)] == ["count from 0", None, "count from 10"]
    assert pool.running == 3 and pool.stats()["env_workers"] == 2
    for _ in range(2):
        out = pool.call({i: ("step", "go") for i in range(3)})
    assert out[0].result == Step("ok 2", None, False, {"n": 2}) and out[2].result.observation == "ok 12"
    out = pool.call({0: ("step", "go"), 1: ("close",)})
    assert out[0].result == Step("ok 3", 1.0, True, {"n": 3}) and out[1].ok and pool.running == 2


@pytest.mark.integration
@pytest.mark.parametrize("action, says, flag", [
    ("hang", "did not answer within env.step_timeout_s=1 s (its worker was killed)", "timed_out"),
    ("segv", "its worker process killed by SIGSEGV", "crashed"),
    ("raise", "Counter.step raised RuntimeError: the game broke", None),
    ("bad-reward", "returned reward nan", None),
    ("three", "returned a tuple of 3", None),
    ("unpicklable", "result cannot be sent", None)])
def test_a_misbehaving_episode_ends_invalid_and_the_pool_serves_on(pool, action, says, flag):
    pool.call({i: ("reset", "p", {}) for i in range(4)})  # two episodes per worker
    out = pool.call({0: ("step", action), 1: ("step", "go"), 2: ("step", "go"), 3: ("step", "go")})
    assert not out[0].ok and says in out[0].error and "\n" not in out[0].error
    assert flag is None or getattr(out[0], flag)
    killed = flag is not None
    mates = [i for i in (1, 2, 3) if not out[i].ok]  # on the killed worker: lost now or at their next request
    assert all(out[i].lost for i in mates) and len(mates) <= 1
    nxt = pool.call({i: ("step", "go") for i in (0, 1, 2, 3)})
    assert not nxt[0].ok and "not running" in nxt[0].error  # an invalid episode is over
    lost = [i for i in (1, 2, 3) if out[i].ok and not nxt[i].ok]
    assert len(mates) + len(lost) == (1 if killed else 0) and all(nxt[i].lost for i in lost)
    assert pool.stats()["env_workers"] == 2 and pool.stats()["restarts"] == int(killed)
    again = pool.call({9: ("reset", "p", {}), 10: ("reset", "p", {})})
    assert again[9].result == "count from 0" and again[10].ok  # replaced worker serves



@pytest.mark.integration
def test_an_episode_lost_with_its_worker_that_ends_needs_no_close_and_is_counted_once():
    pool = EnvironmentWorkers("counter_envs:Counter", workers=1, step_timeout_s=30.0)
    try:
        pool.call({0: ("reset", "p", {}), 1: ("reset", "p", {})})  # one worker holds both
        assert pool.call({0: ("step", "segv")})[0].crashed
        assert pool.call({1: ("close",)})[1].ok  # its episode was over: nothing lost that it needed
        assert pool.stats()["lost"] == 0 and pool.running == 0
    finally:
        pool.close()

"""Tool environments (cluster/envs): the calculator evaluates arithmetic and nothing else, tool
calls are read in the tagged JSON and short forms, a tool's failure is its answer, a call that
cannot be read ends the episode invalid, and the final answer is scored by the columns."""
import pytest

from actors.environments import Calculator, MalformedToolCall, ToolEnvironment, calculator
from actors.environments.workers import EnvironmentWorkers


@pytest.mark.unit
@pytest.mark.parametrize("expression, value", [("12*7", "84"), ("(3+4)*-2", "-14"), ("7/2", "3.5"), ("2**10", "1024"),
                                               (" 9 // 2 % 3 ", "1"), ("1.5+1.5", "3")])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.unit
@pytest.mark.parametrize("expression, says", [("__import__('os')", "unsupported element Call"), ("x+1", "Name"),
                                              ("2**1000", "exponent"), ("10**60*10**60", "digits"), ("1+", "not an"),
                                              ("1" * 300, "longer than"), ("True+1", "Constant")])
def test_the_calculator_refuses_anything_else(expression, says):
    with pytest.raises(ValueError, match=says):
        calculator(expression)


def _episode(env_cls, columns=None):
    env = env_cls()
    assert env.reset("What is 12 times 7?", columns or {"answer": "84"}) is None
    return env


@pytest.mark.unit
def test_a_calculator_episode_calls_then_answers():
    env = _episode(Calculator)
    obs, reward, done, info = env.step('Let me check. <tool_call>{"name": "calculator", "arguments": '
                                       '{"expression": "12*7"}}</tool_call>')
    assert (obs, reward, done) == ("<tool_response>84</tool_response>", None, False) and info["tool_calls"] == 1
    obs, reward, done, info = env.step("<tool_call>calculator: 1/0</tool_call><tool_call>calculator: 2+2</tool_call>")
    assert obs == "<tool_response>error: ZeroDivisionError: division by zero</tool_response><tool_response>4" \
                  "</tool_response>" and info == {"tool_calls": 3, "tool_errors": 1}
    assert env.step("The answer is 84.") == (None, 1.0, True, {"tool_calls": 3, "tool_errors": 1})
    assert _episode(Calculator, {"answer": "85"}).step("It is 84")[1] == 0.0


@pytest.mark.unit
@pytest.mark.parametrize("action, says", [
    ("<tool_call>calculator: 1+1", "without its closing"), ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>', "missing a required argument"),
    ("<tool_call>calculator 1+1</tool_call>", "needs 'name: argument'"),
    ("<tool_call>calculator: 1</tool_call>" * 9, "more than 8 tool calls")])
def test_a_call_that_cannot_be_read_ends_the_episode(action, says):
    with pytest.raises(MalformedToolCall, match=says):
        _episode(Calculator).step(action)


def lookup(city: str, year: int = 2026) -> str:
    """A user's tool: two arguments, so JSON calls only."""
    return f"{city}@{year}"


Lookup = ToolEnvironment.with_tools(lookup, calculator)


@pytest.mark.unit
def test_functions_registered_as_tools_are_called_by_name():
    env = _episode(Lookup)
    obs, *_ = env.step('<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>')
    assert obs == "<tool_response>Oslo@2026</tool_response>"
    assert env.step("done") == (None, 0.0, True, {"tool_calls": 1, "tool_errors": 0})  # no reward given: 0
    with pytest.raises(ValueError, match="distinct names"):
        ToolEnvironment.with_tools(calculator, calculator)


@pytest.mark.integration
def test_the_calculator_runs_in_environment_workers():
    pool = EnvironmentWorkers("actors.environments:Calculator", workers=1, step_timeout_s=30.0)
    try:
        assert pool.call({0: ("reset", "p", {"answer": 4}), 1: ("reset", "p", {"answer": 5})})[0].ok
        out = pool.call({0: ("step", "<tool_call>calculator: 2+2</tool_call>"), 1: ("step", "<tool_call>x")})
        assert out[0].result.observation == "<tool_response>4</tool_response>"
        assert not out[1].ok and "without its closing </tool_call>" in out[1].error
        assert pool.call({0: ("step", "4")})[0].result.reward == 1.0
        assert (pool.stats()["malformed_actions"], pool.stats()["errors"]) == (1, 0)  # the policy's fault
    finally:
        pool.close()


@pytest.mark.unit
def test_the_final_answer_is_checked_against_a_number_or_a_worked_solution():
    from actors.environments.calculator import answer_matches
    responses = ["So the answer is 1,234.", "It is 72", "72 apples, then 5", "no number"]
    assert answer_matches([""] * 4, responses, answer=["1234", "Natalia sold 48+24 = 72 clips.\n#### 72", 72, 5]) \
        == [1.0, 1.0, 0.0, 0.0]  # the last number counts

"""Which error ends a job with which code, decided in one place (cluster.job.errors.exit_status):
every user mistake derives from core.infra.errors.UserError; anything else is a failure of tether's."""
from pathlib import Path

import pytest

from cluster.job.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USER_ERROR, Stopped, exit_status
from cluster.runtime.loop.reward_check import InvalidScores
from cluster.runtime.state.checkpoint import CheckpointError
from core.infra.errors import InputError, UserError, user_input
from core.infra.schema import ConfigError
from core.modeling.architectures import UnsupportedModel

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("error", [ConfigError("config: run.steps=0 must be >= 1"), CheckpointError("x"),
                                   InvalidScores("x"), UnsupportedModel("x"), UserError("x"), InputError("x")])
def test_every_user_mistake_exits_2_in_one_line(error):
    code, line = exit_status(error)
    assert code == EXIT_USER_ERROR and line == f"error: {error}"


@pytest.mark.parametrize("error", [ValueError("bug"), KeyError("bug"), TypeError("bug"), FileNotFoundError("bug")])
def test_any_other_error_is_a_failure(error):
    code, line = exit_status(error)
    assert code == EXIT_FAILED and line.startswith("run failed: ") and line.endswith("(traceback above)")
    error.error_log = Path("/runs/r/error.log")  # the run folder recorded it
    assert exit_status(error)[1].endswith("(traceback in /runs/r/error.log)")


def test_stops_and_interrupts_keep_their_codes():
    assert exit_status(Stopped("stopped at step 3", 143, run_dir=Path("r"))) == (143, "stopped at step 3")
    assert exit_status(KeyboardInterrupt()) == (EXIT_INTERRUPTED, "interrupted")


def test_user_input_makes_only_the_wrapped_calls_errors_the_users():
    with pytest.raises(InputError, match="^data: bad row$"):
        with user_input("data: "):
            raise ValueError("bad row")
    with pytest.raises(KeyError):  # not a kind the call is said to raise for bad input: a bug
        with user_input():
            raise KeyError("bug")

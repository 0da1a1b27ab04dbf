"""The learner -> generator weight contract (core/infra/weights.py): the Generator actor and its weight
receiver offer every method the learner's transports call, with the protocol's signature."""
import inspect

import pytest

from actors.generator import Generator
from actors.weight_receiver import EngineWeights
from core.infra.weights import IN_UPDATE_GROUP, WEIGHT_UPDATE_GROUP, WeightReceiver, remote_method

pytestmark = pytest.mark.unit

CONTRACT = sorted(name for name, member in vars(WeightReceiver).items()
                  if inspect.isfunction(member) and not name.startswith("_"))


# Ray's tracing adds this keyword to the signature of every method of a class once the class
# is made an actor in this process (ray.remote(Generator) in another test): the class's own
# functions are changed in place, so the contract compares what the code declares.
RAY_TRACE_PARAMETER = "_ray_trace_ctx"


def shape(function) -> tuple:
    """What a caller relies on: parameter names, kinds and defaults in order, and the return annotation."""
    sig = inspect.signature(function)
    return ([(p.name, p.kind, p.default) for p in sig.parameters.values() if p.name != RAY_TRACE_PARAMETER],
            sig.return_annotation)


def test_the_contract_lists_the_transports_calls():
    assert CONTRACT == ["finish_weight_update", "init_weight_transfer", "load_adapter", "load_weights",
                        "shutdown_weight_transfer",
                        "start_weight_update", "update_weights", "version", "weight_transfer_gpus"]
    assert IN_UPDATE_GROUP <= set(CONTRACT)


@pytest.mark.parametrize("implementation", [Generator, EngineWeights])
@pytest.mark.parametrize("name", CONTRACT)
def test_implements_the_contract(implementation, name):
    method = getattr(implementation, name, None)
    assert callable(method), f"{implementation.__name__} lacks {name}()"
    assert shape(method) == shape(getattr(WeightReceiver, name))


def test_the_contract_holds_once_the_class_is_made_an_actor():
    """ray.remote changes the class's methods in place (in this process, for every later test):
    the contract must hold before and after, whichever test decorated the class first."""
    import ray
    ray.remote(num_cpus=1)(Generator)  # decoration only: no Ray, no actor
    for name in CONTRACT:
        assert shape(getattr(Generator, name)) == shape(getattr(WeightReceiver, name)), name


class Handle:
    """A Ray actor handle's shape: each method has .options(...) and .remote(...)."""

    class Method:
        def __init__(self, name: str, options: dict | None = None) -> None:
            self.name, self.options_ = name, options

        def options(self, **options):
            return Handle.Method(self.name, options)

    def __getattr__(self, name: str):
        return Handle.Method(name)


def test_remote_method_runs_weight_changes_in_the_update_group():
    update = remote_method(Handle(), WeightReceiver.load_weights)
    assert (update.name, update.options_) == ("load_weights", {"concurrency_group": WEIGHT_UPDATE_GROUP})
    query = remote_method(Handle(), WeightReceiver.version)
    assert (query.name, query.options_) == ("version", None)


def test_remote_method_takes_only_the_contracts_methods():
    with pytest.raises(TypeError, match="not a method of the weight contract"):
        remote_method(Handle(), Generator.sample)

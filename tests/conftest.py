import contextlib
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# DeepSpeed compiles its CPU communication op on first use into torch's extensions folder, under
# a lock file. One folder per Python environment: checkouts with other environments would
# otherwise rebuild it in turn, and a process killed mid-build leaves the lock for all to wait on.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

# Every test carries exactly one tier. `gpu` (needs CUDA) and `slow` (left out of the default
# run) are extra markers on top of a tier, not tiers: a GPU test is an integration or e2e test
# that also needs a GPU.
TIERS = ("unit", "integration", "e2e")
# pytest-timeout's limit per test (setup, call and teardown; pyproject.toml sets the method and
# the 900 s default of the integration and e2e tiers). A test's own @pytest.mark.timeout wins.
UNIT_TIMEOUT_S = 120     # pure functions: seconds each, even on a loaded 2-core machine
SLOW_TIMEOUT_S = 1800    # the slow tier's full runs (not in CI)


# --require-passed: the GPU scripts' pytest runs exit with this when no test passed (all
# skipped, e.g. no usable CUDA): such a run checked nothing and must not read as a pass.
NOTHING_PASSED_EXIT = 6


def pytest_addoption(parser):
    parser.addoption("--require-passed", action="store_true",
                     help=f"exit {NOTHING_PASSED_EXIT} when no selected test passed (every one skipped)")


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _PASSED.append(report.nodeid)


_PASSED: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("require_passed") and exitstatus == 0 and not _PASSED:
        session.exitstatus = NOTHING_PASSED_EXIT


def pytest_unconfigure(config):
    # After every fixture's teardown (some kill actors of the shared Ray): the session's shared
    # Ray (tests/rays.py) goes, if a test started it.
    if "rays" in sys.modules:
        sys.modules["rays"].stop()
    if _PREBUILD is not None:
        sys.modules["model_prebuild"].stop(_PREBUILD)


_PREBUILD = None  # the background model builds (tests/model_prebuild.py), when the session started them


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if config.getoption("require_passed") and exitstatus == 0 and not _PASSED:
        terminalreporter.write_line(f"--require-passed: no test passed (every selected test was skipped), exit "
                                    f"{NOTHING_PASSED_EXIT}: this run checked nothing; the skip reasons say why (-rs)")


def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
        elif item.get_closest_marker("timeout") is None:
            if item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
            elif tiers == ["unit"]:
                item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) do not carry exactly one tier marker ({', '.join(TIERS)}; gpu and slow "
            "come on top of one); mark each (a module-level pytestmark is fine):\n" + "\n".join(wrong))
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="gpu tier: no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Before the first integration or e2e test: DeepSpeed's CPU communication op built (or its
    build found up to date), here in the pytest process. Built on first use instead, the build
    could fall in a learner rank that a fault test SIGKILLs, whose lock file every later
    DeepSpeed start would then wait on for ever."""
    import model_prebuild  # the tiny models built on the idle core meanwhile (tests/model_prebuild.py)

    if session.config.option.collectonly or not model_prebuild.wanted(session.items):
        return
    global _PREBUILD
    _PREBUILD = model_prebuild.start(Path(session.config.rootpath) / ".test-results" / "model-prebuild.log")
    import torch
    if torch.cuda.is_available():  # the GPU tier's learner runs on CUDA: no CPU op to build
        return
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def pytest_report_header(config):
    """The precision this machine's tests run at: the CPU's native-bf16 instruction sets and what
    model.dtype=auto resolves to (bf16 ties and roundings show up only where it is bf16)."""
    from core.infra.dtypes import cpu_bf16_flags, resolve_precision
    flags = cpu_bf16_flags()
    dtype, why = resolve_precision("auto", on_gpu=False)
    return [f"tether: CPU bf16: {', '.join(flags) if flags else 'none'}; model.dtype=auto resolves to {dtype} ({why})"]


# ---------------------------------------------------------------- `unit` means no process, no actor
class UnitTierViolation(AssertionError):
    """A unit test started a process or used Ray: it belongs in the integration tier."""


class _UnitGuard:
    """While a unit test runs (its fixtures' set-up and teardown included), starting a process
    (subprocess, fork, posix_spawn, os.system, multiprocessing, the forking entrypoint server) or
    touching Ray (ray.init, creating an actor or task, calling an actor) raises. What was tried is
    also kept, so a test whose code swallows the error still fails at teardown."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.tried, self._mp = nodeid, [], pytest.MonkeyPatch()

    def _refuse(self, what: str, command=None, original=None):
        def refuse(*args, **kwargs):
            if original is not None and _importing():
                # A library probing its platform while it is first imported (vLLM runs
                # `uname -p`): that depends on which test imported it first, not on the test.
                return original(*args, **kwargs)
            if command is not None:  # name what it tried to run
                what_ = f"{what} ({_shorten(command(*args, **kwargs))})"
            else:
                what_ = what
            self.tried.append(what_)
            raise UnitTierViolation(f"{self.nodeid} is marked unit but {what_}; a unit test starts no process "
                                    "and no Ray actor: mark it integration (tests/conftest.py)")
        return refuse

    def install(self) -> "_UnitGuard":
        import multiprocessing.process
        import subprocess

        import ray
        import ray.actor
        import ray.remote_function

        mp = self._mp
        mp.setattr(subprocess.Popen, "__init__",
                   self._refuse("started a subprocess", lambda popen, args, *a, **k: args, subprocess.Popen.__init__))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, self._refuse(f"called os.{name}", lambda *a, **k: a[:2], getattr(os, name)))
        mp.setattr(multiprocessing.process.BaseProcess, "start", self._refuse("started a multiprocessing process"))
        mp.setattr(ray, "init", self._refuse("called ray.init"))
        mp.setattr(ray.actor.ActorClass, "_remote", self._refuse("created a Ray actor"))
        mp.setattr(ray.actor.ActorMethod, "_remote", self._refuse("called a Ray actor"))
        mp.setattr(ray.remote_function.RemoteFunction, "_remote", self._refuse("started a Ray task"))
        server = sys.modules.get("entrypoints")  # tests/entrypoints.py: forks a child per command
        if server is not None:
            mp.setattr(server.EntrypointServer, "run", self._refuse("ran an entrypoint in a forked child"))
        return self

    def undo(self) -> None:
        self._mp.undo()


def _importing() -> bool:
    """True while a module is being imported (a frame of importlib's machinery is on the stack)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def _shorten(command) -> str:
    text = " ".join(map(str, command)) if isinstance(command, (list, tuple)) else str(command)
    return text if len(text) <= 120 else text[:117] + "..."


_GUARD = pytest.StashKey[_UnitGuard]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("unit") is not None:
        item.stash[_GUARD] = _UnitGuard(item.nodeid).install()
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        guard = item.stash.get(_GUARD, None)
        if guard is not None:
            del item.stash[_GUARD]
            guard.undo()
            if guard.tried:
                raise UnitTierViolation(f"{item.nodeid} is marked unit but {'; '.join(dict.fromkeys(guard.tried))}: "
                                        "mark it integration")


# ---------------------------------------------------------------- nothing outlives its test
# Modules share a Ray (and module fixtures share actors across their tests), so what a test
# leaves behind would change the tests after it. After each test (and each module), the named
# actors, placement groups and alive nodes it added must be gone: a leftover fails the test that
# left it, not whichever test it disturbs. Teardown is asynchronous in Ray (an actor killed a
# moment ago is still listed), so the check waits for them to go, up to LEFTOVER_WAIT_S.
LEFTOVER_WAIT_S = 60.0


def _ray_state() -> dict[str, set] | None:
    """Named actors, placement groups not removed, alive nodes of the Ray this process is
    connected to; None when it is not connected."""
    import ray
    if not ray.is_initialized():
        return None
    from ray.util import list_named_actors, placement_group_table
    try:
        actors = {f"{a['namespace']}/{a['name']}" for a in list_named_actors(all_namespaces=True)}
        groups = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    except (ray.exceptions.RayError, ConnectionError, RuntimeError, TimeoutError):
        # the cluster went away under the test (a head node killed on purpose)
        return None
    return {"named actors": actors, "placement groups": groups, "nodes": nodes}


def _leftovers(before: dict[str, set] | None) -> dict[str, set]:
    after = _ray_state()
    if before is None or after is None:  # Ray started or ended in between: its own start/shutdown cleans up
        return {}
    return {what: extra for what in after if (extra := after[what] - before[what])}


def _assert_nothing_left(before: dict[str, set] | None, who: str) -> None:
    import time
    deadline = time.monotonic() + LEFTOVER_WAIT_S
    while (left := _leftovers(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        listed = "; ".join(f"{what}: {sorted(ids)}" for what, ids in left.items())
        raise AssertionError(f"{who} left behind in the shared Ray {listed} (kill/remove them in its teardown)")


@pytest.fixture(autouse=True)
def _nothing_outlives_the_test(request):
    if request.node.get_closest_marker("unit") is not None:
        yield
        return
    before = _ray_state()
    yield
    _assert_nothing_left(before, request.node.nodeid)


@pytest.fixture(autouse=True)
def _gloo_interface_restored():
    """A learner rank built in this process names its gloo interface in os.environ
    (learner/rendezvous.py): the next test, and the raylets it starts, must not inherit it."""
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    yield
    if before is None:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    else:
        os.environ["GLOO_SOCKET_IFNAME"] = before


@pytest.fixture(autouse=True, scope="module")
def _nothing_outlives_the_module(request):
    before = _ray_state()
    yield
    _assert_nothing_left(before, request.node.nodeid)


# ---------------------------------------------------------------- vLLM engines in this process
class _EnginesHere:
    """vLLM's engines inside this process, as a CPU generator or judge actor hosts them
    (``engine_process_env``): an engine starts in ~10 s here, ~28 s with an engine process of its
    own (and a bf16 engine's own worker process died of SIGILL at its first step in 2 of 4 runs).

    The engines join torch.distributed in this process and share vLLM's distributed state, which
    any one of them tears down when it is collected (its finalizer), whichever engine or test is
    still using it. So a learner's group an earlier test left here is destroyed first, through
    DeepSpeed, which then forgets the groups it cached on it; every engine built meanwhile is held
    (``hold``) until the end, when all are collected at once and every bit of vLLM's distributed
    state is dropped: a later in-process learner sets up its own group from nothing."""

    def __init__(self):
        self._held = []

    def hold(self, engine):
        self._held.append(engine)
        return engine

    @contextlib.contextmanager
    def hosting(self):
        import gc

        import deepspeed.comm
        import torch.distributed as dist
        from vllm import envs
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        from actors.generator import engine_process_env
        if dist.is_initialized():
            deepspeed.comm.destroy_process_group()
        envs.disable_envs_cache()  # an earlier engine's cache would keep the old settings
        with pytest.MonkeyPatch.context() as patch:
            for key, value in engine_process_env(num_gpus=0, tensor_parallel=1).items():
                patch.setenv(key, value)
            try:
                yield self
            finally:
                self._held.clear()
                gc.collect()  # the engines' finalizers tear vLLM's state down here, not in a later test
                cleanup_dist_env_and_memory()  # vLLM's groups, the process group, its cache of the environment


@pytest.fixture
def in_process_engine():
    """The test's engines in this process (_EnginesHere), dropped after it."""
    with _EnginesHere().hosting() as engines:
        yield engines


@pytest.fixture(scope="module")
def in_process_engines():
    """The module's engines in this process (_EnginesHere): a test's own engine is held
    (``in_process_engines.hold(Generator(...))``) until the module ends. Not with
    ``in_process_engine`` in one module: that one's teardown would drop these engines' state."""
    with _EnginesHere().hosting() as engines:
        yield engines


# Tiny offline models (cached on disk by content): one build serves every test session.
@pytest.fixture(scope="session")
def policy_path():
    from cluster.demo.tiny_models import build_policy
    return str(build_policy())


@pytest.fixture(scope="session")
def reward_path():
    from cluster.demo.tiny_models import build_reward_model
    return str(build_reward_model())


@pytest.fixture(scope="session")
def tokenizer(policy_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(policy_path)


@pytest.fixture(scope="session")
def entrypoints():
    """`python -m <module> ...` in forked children of one process that imported the stack once
    (tests/entrypoints.py): the user-mistake cases cost milliseconds instead of ~6 s each."""
    from entrypoints import EntrypointServer

    server = EntrypointServer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def _module_nodes():
    """One multi-node Ray per test module (tests/nodes.py): a head node, this process connected."""
    import ray
    import rays
    from nodes import LocalNodes
    rays.leave()
    nodes = LocalNodes()
    ray.init(address=nodes.address, logging_level="WARNING")
    try:
        yield nodes
    finally:
        nodes.shutdown()


@pytest.fixture(scope="module")
def _module_netns_nodes(request, tmp_path_factory):
    """One Ray per test module whose worker nodes get network namespaces and addresses of their
    own (tests/netns_nodes.py; the module's NETNS_SYSTEM_CONFIG, if any, is Ray's system config).
    Skips where namespaces cannot be made (not root, no `ip netns`)."""
    import rays
    from netns_nodes import NetnsNodes

    from cluster.nodes import netns
    try:
        netns.check_available()
    except netns.NetnsError as e:
        pytest.skip(f"no network namespaces here: {e}")
    rays.leave()
    nodes = NetnsNodes(tmp_path_factory.mktemp("netns"),
                       system_config=getattr(request.module, "NETNS_SYSTEM_CONFIG", None))
    try:
        nodes.connect()
        yield nodes
    finally:
        left = nodes.shutdown()
        assert left == [], f"left behind by the namespaced cluster: {left}"


@pytest.fixture
def netns_nodes(_module_netns_nodes):
    """The module's namespaced Ray; the worker nodes (and namespaces) this test adds go after it."""
    kept = set(_module_netns_nodes.nodes)
    yield _module_netns_nodes
    _module_netns_nodes.remove_all_but(kept)


@pytest.fixture
def ray_nodes(_module_nodes):
    """The module's multi-node Ray; the worker nodes this test adds are removed after it."""
    kept = set(_module_nodes.nodes)
    yield _module_nodes
    _module_nodes.remove_all_but(kept)

"""Learner start-up: rank 0's store holds its port from the moment the OS picks it, and a
failed rendezvous is retried with a fresh store (learner/rendezvous.py, LearnerGroup._start)."""
import datetime
import logging
import socket
import time

import pytest
import torch.distributed as dist
from helpers import sgd_config

from core.infra.errors import type_and_first_line
from learner.group import RENDEZVOUS_ATTEMPTS, LearnerGroup
from learner.rendezvous import RendezvousError, StoreAddress, candidate_port, is_address_in_use, open_store

CHEAPEST = sgd_config(zero_stage=0, epochs=1, minibatch=2, micro=1)  # 2 ranks x 1 micro-batch


# ------------------------------------------------------------------------------ pure


@pytest.mark.unit
def test_store_holds_the_port_the_os_picked():
    store, address = open_store(world_size=2, timeout_s=10)
    assert address.port > 0
    client = dist.TCPStore(address.host, address.port, 2, is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    client.set("rank1", "here")
    assert store.get("rank1") == b"here"
    # Held, not released: a second server cannot bind it, and says so in words we recognise.
    with pytest.raises(Exception) as taken:
        dist.TCPStore(address.host, address.port, 2, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=5))
    assert is_address_in_use(taken.value), str(taken.value)


@pytest.mark.unit
def test_address_in_use_is_told_apart_from_other_failures():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with socket.socket() as t, pytest.raises(OSError) as err:
            t.bind(("127.0.0.1", s.getsockname()[1]))
    assert is_address_in_use(err.value)
    try:
        try:
            raise OSError(98, "Address already in use")
        except OSError as e:
            raise RuntimeError("vLLM could not open the trainer endpoint") from e
    except RuntimeError as wrapped:
        assert is_address_in_use(wrapped)  # found through the cause
    assert not is_address_in_use(TimeoutError("store unreachable"))
    assert not is_address_in_use(ConnectionRefusedError(111, "Connection refused"))
    assert all(20000 <= candidate_port() < 32768 for _ in range(100))
    assert type_and_first_line(RuntimeError("first line\nsecond line")) == "RuntimeError: first line"


# ------------------------------------------------------------------------ two ranks on Ray


@pytest.mark.integration
@pytest.mark.parametrize("starts", [3, pytest.param(20, marks=pytest.mark.slow)])
def test_two_rank_group_starts_and_stops_repeatedly(ray_cluster, policy_path, starts):
    t0 = time.perf_counter()
    for _ in range(starts):
        group = LearnerGroup(model=policy_path, config=CHEAPEST, world_size=2, num_cpus_per_rank=0,
                             name_prefix="learner-start")  # reused at once, as a restart does
        try:
            health = group.health()
            assert [h["rank"] for h in health] == [0, 1]
            assert all(h["built"] and h["backend"] == "gloo" and h["world_size"] == 2 for h in health)
        finally:
            group.shutdown()
    print(f"{starts} starts and stops of a 2-rank group: {time.perf_counter() - t0:.1f}s")


class DeadStoreGroup(LearnerGroup):
    """Sends rank 1 to a port that is bound but never listens for the first ``failures`` attempts."""
    failures = 0

    def _open_store(self, timeout):
        address = super()._open_store(timeout)
        self.opened = getattr(self, "opened", 0) + 1
        return StoreAddress(address.host, self.dead_port) if self.opened <= self.failures else address


@pytest.fixture
def dead_port():
    with socket.socket() as s:  # bound, so nobody else gets it; not listening, so connecting fails
        s.bind(("", 0))
        yield s.getsockname()[1]


@pytest.mark.integration
# The slow tier: five rendezvous timeouts. The default tier: test_two_rank_group_starts_and_stops_repeatedly
# (above) holds the rendezvous itself.
@pytest.mark.slow
def test_failed_rendezvous_is_retried_with_a_fresh_store_then_given_up(ray_cluster, policy_path, dead_port,
                                                                       caplog):
    def start(failures):
        cls = type("Group", (DeadStoreGroup,), {"failures": failures, "dead_port": dead_port})
        return cls(model=policy_path, config=CHEAPEST, world_size=2, num_cpus_per_rank=0,
                   name_prefix=f"learner-retry{failures}", rendezvous_timeout_s=3)

    caplog.set_level(logging.WARNING, logger="learner.group")
    group = start(failures=1)
    try:
        assert group.opened == 2 and all(h["built"] for h in group.health())
    finally:
        group.shutdown()
    warnings = [r.getMessage() for r in caplog.records if r.name == "learner.group"]
    assert len(warnings) == 1 and warnings[0].startswith("learner: rendezvous failed (")
    assert warnings[0].endswith("; retrying with a fresh port (attempt 2/3)") and "\n" not in warnings[0]

    caplog.clear()
    with pytest.raises(RendezvousError, match=r"learner: rendezvous failed 3 times, giving up; last error: "):
        start(failures=RENDEZVOUS_ATTEMPTS)
    warnings = [r.getMessage() for r in caplog.records if r.name == "learner.group"]
    assert [w[-len("(attempt 2/3)"):] for w in warnings] == ["(attempt 2/3)", "(attempt 3/3)"]

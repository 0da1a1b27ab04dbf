"""Ray's worker-death banner goes to the log on the Ray release the rerouting was tested on (its
node-death one: tests/cluster/runtime/pools/test_nodes.py), and Ray's printer is left alone on
any other (cluster/runtime/observe/console.py). The banner is Ray's own: a worker killed in a
task of a real local Ray."""
import logging
import os
import time

import pytest
import ray
import ray._private.worker as ray_worker

from cluster.runtime.observe.console import BANNER_REROUTE_TESTED, RAYLET_DIED, WORKER_DIED, death_banners_to_log

# Not the banner: a message of the raylet's that must still reach the console.
OTHER = {"pid": "raylet", "ip": "127.0.0.1", "is_err": True, "lines": ["something else the raylet has to say"]}


@pytest.mark.unit
def test_the_installed_ray_is_one_the_rerouting_was_tested_on():
    assert ray.__version__.startswith(BANNER_REROUTE_TESTED), ray.__version__


@pytest.fixture
def local_ray():
    import rays
    rays.leave()  # a Ray of its own: the banner it checks is printed once per worker death
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()


@ray.remote(max_retries=0)
def dies():
    os._exit(1)


@pytest.mark.integration
def test_rays_banner_becomes_log_records_and_other_messages_still_print(local_ray, capfd, caplog):
    original = ray_worker.print_to_stdstream
    with caplog.at_level(logging.WARNING, logger="ray.raylet"), death_banners_to_log():
        assert ray_worker.print_to_stdstream is not original
        with pytest.raises(ray.exceptions.WorkerCrashedError):
            ray.get(dies.remote())
        # Ray's driver prints the raylet's banner from a thread of its own, after the task failed.
        deadline = time.monotonic() + 60
        while not (banner := [r.getMessage() for r in caplog.records if r.name == "ray.raylet"]):
            assert time.monotonic() < deadline, "Ray's driver got no banner for the killed worker within 60 s"
            time.sleep(0.05)
        ray_worker.print_to_stdstream(OTHER, ignore_prefix=False)
    assert ray_worker.print_to_stdstream is original
    out = capfd.readouterr()
    assert WORKER_DIED not in out.out + out.err and "something else" in out.out + out.err, out
    assert banner[0].startswith(f"{WORKER_DIED} while executing a task"), banner


@pytest.mark.unit
def test_on_an_untested_ray_the_printer_is_left_alone(monkeypatch):
    monkeypatch.setattr(ray, "__version__", "2.99.0")
    original = ray_worker.print_to_stdstream
    with death_banners_to_log():
        assert ray_worker.print_to_stdstream is original


@pytest.mark.unit
def test_a_returning_nodes_raylet_termination_report_goes_to_the_log(monkeypatch, caplog):
    """What Ray's driver printed when a node cut off the network came back and its raylet exited
    (seen on a namespaced cluster: a 20-line dump of that raylet's log)."""
    printed = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data))
    report = {"pid": "raylet", "ip": "10.163.111.1", "is_err": True, "lines": [
        f"{RAYLET_DIED}. Termination is unexpected. Possible reasons include: (1) SIGKILL by the user or system "
        "OOM killer, (2) Invalid memory access from Raylet causing SIGSEGV or SIGBUS, (3) Other termination "
        "signals. Last 20 lines of the Raylet logs:", "    [state-dump] \tNodeManager.GcsCheckAlive - 1 total"]}
    with caplog.at_level(logging.WARNING, logger="ray.raylet"), death_banners_to_log():
        ray_worker.print_to_stdstream(report, ignore_prefix=False)
        ray_worker.print_to_stdstream(OTHER, ignore_prefix=False)
    assert printed == [OTHER]
    assert [r.getMessage() for r in caplog.records if r.name == "ray.raylet"] == report["lines"]

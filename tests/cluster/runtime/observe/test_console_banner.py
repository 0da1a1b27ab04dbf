"""Ray's worker-death banner goes to the log on the Ray release the rerouting was tested on,
and Ray's printer is left alone on any other (cluster/runtime/observe/console.py)."""
import logging

import pytest
import ray
import ray._private.worker as ray_worker

from cluster.runtime.observe.console import BANNER_REROUTE_TESTED, worker_deaths_to_log

pytestmark = pytest.mark.unit

BANNER = {"pid": "raylet", "ip": "127.0.0.1", "is_err": True,
          "lines": ["A worker died or was killed while executing a task by an unexpected system error.",
                    "RayTask ID: ffff Worker ID: 1234"]}
OTHER = {"pid": "raylet", "ip": "127.0.0.1", "is_err": True, "lines": ["something else the raylet has to say"]}


def test_the_installed_ray_is_one_the_rerouting_was_tested_on():
    assert ray.__version__.startswith(BANNER_REROUTE_TESTED), ray.__version__


def test_the_banner_becomes_log_records_and_other_messages_still_print(capsys, caplog):
    original = ray_worker.print_to_stdstream
    with caplog.at_level(logging.WARNING, logger="ray.raylet"), worker_deaths_to_log():
        assert ray_worker.print_to_stdstream is not original
        ray_worker.print_to_stdstream(BANNER, ignore_prefix=False)
        ray_worker.print_to_stdstream(OTHER, ignore_prefix=False)
    assert ray_worker.print_to_stdstream is original
    out = capsys.readouterr()
    assert "A worker died" not in out.out + out.err and "something else" in out.out + out.err
    assert [r.getMessage() for r in caplog.records if r.name == "ray.raylet"] == BANNER["lines"]


def test_on_an_untested_ray_the_printer_is_left_alone(monkeypatch):
    monkeypatch.setattr(ray, "__version__", "2.99.0")
    original = ray_worker.print_to_stdstream
    with worker_deaths_to_log():
        assert ray_worker.print_to_stdstream is original

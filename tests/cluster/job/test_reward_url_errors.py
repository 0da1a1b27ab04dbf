"""reward.url mistakes through the real entrypoint: a reward server that is down, does not answer
or speaks another schema is refused before any actor starts (one line naming the URL, exit 2).

The server is a thread of this process on loopback (tests/reward_server.py); the run is
`python -m cluster.train` in a child process (tests/entrypoints.py), and once in a fresh interpreter.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from entrypoints import assert_one_line_error
from reward_server import ClosedPort, RewardServer

from actors.rewards.source import one_source_rule

pytestmark = pytest.mark.integration  # each case runs an entrypoint in a child process
REPO = Path(__file__).resolve().parents[3]
ENV = {"RAY_ADDRESS": ""}


def _url_args(url: str, *more: str) -> list[str]:
    return ["reward.function=null", f"reward.url={url}", *more]


def test_a_server_that_is_down_is_refused_naming_the_url(tmp_path, entrypoints):
    with ClosedPort() as port:
        result = entrypoints.run("cluster.train", [f"run.dir={tmp_path / 'runs'}", *_url_args(port.url)], env=ENV)
    assert_one_line_error(result, tmp_path / "runs", f"reward.url={port.url!r}: the reward server did not answer "
                                                     "(ClientConnectorError")
    assert "start the server (or correct reward.url) before the run" in result.stderr


def test_a_server_that_does_not_answer_is_refused_after_the_timeout(tmp_path, entrypoints):
    server = RewardServer(lambda i, body: server.hang())
    with server:
        result = entrypoints.run("cluster.train", [f"run.dir={tmp_path / 'runs'}",
                                                   *_url_args(server.url, "reward.http.timeout_s=1")], env=ENV)
    assert_one_line_error(result, tmp_path / "runs", f"reward.url={server.url!r}: the reward server did not answer "
                                                     "within reward.http.timeout_s=1 s on a start-up probe")
    assert len(server.bodies) == 1  # the probe does not retry


@pytest.mark.parametrize("status, text, message", [
    (200, '{"score": 0.5}', 'replied with JSON without a "rewards" list (keys [\'score\'])'),
    (422, '{"detail": "field required"}', "replied HTTP 422"),
    (200, '{"rewards": [0.5]}', "returned 1 scores for 2 items"),
], ids=["wrong-schema", "client-error", "wrong-count"])
def test_a_server_speaking_another_schema_is_refused(tmp_path, entrypoints, status, text, message):
    with RewardServer(lambda i, body: (status, text)) as server:
        result = entrypoints.run("cluster.train", [f"run.dir={tmp_path / 'runs'}", *_url_args(server.url)], env=ENV)
    assert_one_line_error(result, tmp_path / "runs", message)
    assert f"reward.url={server.url!r}" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["reward.url=http://127.0.0.1:9/get_reward"],
     one_source_rule()),
    (["reward.function=null", "reward.url=localhost:5000"], "reward.url='localhost:5000' is not an http(s) URL"),
    (["reward.function=null", "reward.url=http://h/x", "reward.http.concurrency=0"],
     "reward.http.batch_size=64 and concurrency=0 must be >= 1"),
], ids=["url-and-function", "url-without-scheme", "concurrency-zero"])
def test_reward_url_config_mistakes(tmp_path, entrypoints, args, message):
    result = entrypoints.run("cluster.train", [f"run.dir={tmp_path / 'runs'}", *args], env=ENV)
    assert_one_line_error(result, tmp_path / "runs", message)


def test_a_server_that_is_down_is_refused_in_a_fresh_interpreter(tmp_path):
    with ClosedPort() as port:
        result = subprocess.run([sys.executable, "-m", "cluster.train", f"run.dir={tmp_path / 'runs'}",
                                 *_url_args(port.url)], cwd=REPO, text=True, capture_output=True, timeout=300,
                                env={**os.environ, **ENV})
    assert_one_line_error(result, tmp_path / "runs", f"reward.url={port.url!r}: the reward server did not answer")

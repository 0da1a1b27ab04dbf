"""Reward functions that take their time: slow enough that a test can kill the reward actor while it
scores, never returning (reward.timeout_s), or killing its replica."""
import os
import signal
import time
from pathlib import Path

import psutil

from cluster.demo.sentiment import sentiment
from cluster.runtime.prepare import PROBE_RESPONSES

SECONDS = 0.5


def _marks() -> Path:
    """The folder $TETHER_TEST_MARKS names (tests/e2e/conftest.py's cluster_with_test_rewards:
    one per test module), where a reward notes what it has done on a Ray node."""
    return Path(os.environ["TETHER_TEST_MARKS"])


def slow_sentiment(prompts, responses):
    time.sleep(SECONDS)
    return sentiment(prompts, responses)


def hangs_after_probe(prompts, responses):
    """Scores the start-up probe's example pairs; never returns on any other call."""
    if list(responses) == list(PROBE_RESPONSES[:len(responses)]):
        return sentiment(prompts, responses)
    time.sleep(3600)
    return sentiment(prompts, responses)


def dies_once(prompts, responses):
    """Scores as sentiment does; the first call after the probe on a Ray node SIGKILLs its own
    process (a reward replica dying while it scores), later calls there score."""
    if list(responses) != list(PROBE_RESPONSES[:len(responses)]):
        raylet = psutil.Process(os.getppid())  # Ray's workers are its raylet's children
        marker = _marks() / f"died-{raylet.pid}-{raylet.create_time():.0f}"
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return sentiment(prompts, responses)
        os.kill(os.getpid(), signal.SIGKILL)
    return sentiment(prompts, responses)


HANGS_PER_NODE = 3


def hangs_on_a_few_pairs(prompts, responses):
    """Scores as sentiment does, in a reward.sandbox worker (one pair per call); the first
    HANGS_PER_NODE pairs after the probe on a Ray node never return."""
    if list(responses) != list(PROBE_RESPONSES[:len(responses)]):
        raylet = psutil.Process(psutil.Process(os.getppid()).ppid())  # worker -> reward replica -> raylet
        for k in range(HANGS_PER_NODE):
            marker = _marks() / f"hang-{raylet.pid}-{raylet.create_time():.0f}-{k}"
            try:
                marker.touch(exist_ok=False)
            except FileExistsError:
                continue
            time.sleep(3600)
    return sentiment(prompts, responses)

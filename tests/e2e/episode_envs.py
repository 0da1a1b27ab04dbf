"""Environments for the episode e2e tests, imported by name in the generators' workers."""
import os
import threading
import time
from pathlib import Path


class SayMore:
    """Two turns: each step rewards the turn's length (characters / 40, at most 1) and asks again."""

    def reset(self, prompt, columns):
        self.turn = 0
        return "Say more."

    def step(self, action):
        self.turn += 1
        return "Again.", min(len(action), 40) / 40, self.turn >= 2, {"chars": len(action)}


def episode_marks() -> Path:
    """Where MarkedSayMore's steps say which generator they run under, and wait to be let go: a
    folder in the one $TETHER_TEST_MARKS names (tests/e2e/conftest.py's cluster_with_test_rewards
    sets it for the workers and the test alike)."""
    return Path(os.environ["TETHER_TEST_MARKS"]) / "episode-faults"


class MarkedSayMore(SayMore):
    """SayMore whose steps first leave a mark named by the generator's pid (the worker's parent)
    holding the worker's pid, then wait until the test lets them go (a file named release), so a
    test can kill the generator while its episodes wait on their environments. The mark is
    written under another name and renamed: once it exists, it holds the whole pid."""

    def step(self, action):
        marks = episode_marks()
        marks.mkdir(parents=True, exist_ok=True)
        partial = marks / f".{os.getppid()}-{os.getpid()}-{threading.get_ident()}.partial"
        partial.write_text(str(os.getpid()))
        os.replace(partial, marks / str(os.getppid()))
        deadline = time.monotonic() + 120
        while not (marks / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().step(action)

"""Environments for the episode e2e tests, imported by name in the generators' workers."""
import os
import tempfile
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


# Where MarkedSayMore's steps say which generator they run under, and wait to be let go.
MARKS = Path(tempfile.gettempdir()) / "tether-episode-faults"


class MarkedSayMore(SayMore):
    """SayMore whose steps first leave a mark named by the generator's pid (the worker's parent)
    holding the worker's pid, then wait until the test lets them go (a file named release), so a
    test can kill the generator while its episodes wait on their environments."""

    def step(self, action):
        MARKS.mkdir(exist_ok=True)
        (MARKS / str(os.getppid())).write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not (MARKS / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().step(action)

"""Environments for tests/actors/environments/test_env_workers.py: a counter game whose actions say how to misbehave."""
import os
import signal
import time


class Counter:
    """reset -> "count from <start>"; each step answers "ok <n>" and ends at the third step; an
    action names a failure to stage instead."""

    def reset(self, prompt, columns):
        self.n = int(columns.get("start", 0))
        return f"count from {self.n}" if prompt != "silent" else None

    def step(self, action):
        if action == "hang":
            time.sleep(3600)
        if action == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if action == "raise":
            raise RuntimeError("the game broke\nsecond line")
        if action == "bad-reward":
            return "x", float("nan"), False, {}
        if action == "three":
            return "x", 1.0, False
        if action == "unpicklable":
            return "x", 1.0, False, {"f": lambda: 0}
        self.n += 1
        return f"ok {self.n}", (1.0 if self.n % 3 == 0 else None), self.n % 3 == 0, {"n": self.n}


class NoStep:
    def reset(self, prompt, columns):
        return None

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


class Relay:
    """Two roles, by the prompt's columns: "go" answers at once and, at its ``after``-th step,
    writes a byte into the FIFO ``marker``; "wait" holds its first step until that byte can be
    read (a minute at most), so it ends only if other episodes' turns go on while its
    environment works. Each ends with reward 1 at its ``turns``-th step."""

    def reset(self, prompt, columns):
        self.role, self.marker = columns["role"], columns["marker"]
        self.after, self.turns, self.n = int(columns.get("after", 2)), int(columns.get("turns", 3)), 0
        return None

    def step(self, action):
        import select

        self.n += 1
        if self.role == "go" and self.n == self.after:
            # Held open by this instance: the byte stays in the FIFO whenever "wait" opens it.
            self.fifo = os.open(self.marker, os.O_RDWR | os.O_NONBLOCK)
            os.write(self.fifo, b"x")
        if self.role == "wait" and self.n == 1:
            fd = os.open(self.marker, os.O_RDONLY | os.O_NONBLOCK)
            try:
                readable, _, _ = select.select([fd], [], [], 60)
            finally:
                os.close(fd)
            if not readable:
                raise RuntimeError("no marker: the other episodes did not go on meanwhile")
        done = self.n >= self.turns
        return f"ok {self.n}", (1.0 if done else None), done, {}

"""Verifiers that misbehave on the pairs that ask them to, for tests/actors/rewards/test_sandbox.py: each
response names what to do; any other pair scores its length."""
import os
import signal
import time

import numpy as np


def misbehaves(prompts, responses):
    (response,) = responses  # the sandbox calls with one pair
    if response == "hang":
        time.sleep(3600)
    elif response == "exit":
        os._exit(1)
    elif response == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif response == "sigkill":  # what the OOM killer does
        os.kill(os.getpid(), signal.SIGKILL)
    elif response == "hog":
        hog = np.ones(8 << 30, dtype=np.uint8)  # 8 GiB, past any memory_mb a test sets
        return [float(hog.sum())]
    elif response == "pyhog":
        # 1 MiB at a time, in Python, past any memory_mb a test sets; bytes(n) is calloc'd, so the
        # cap is met without writing the pages: within the timeout however fast the machine's memory.
        hog = [bytes(1 << 20) for _ in range(8 << 10)]
        return [float(len(hog))]
    elif response == "raise":
        raise RuntimeError("verifier broke\nsecond line")
    elif response == "none":
        return [None]
    elif response == "string":
        return ["1.0"]
    elif response == "two":
        return [1.0, 2.0]
    elif response == "exit0":
        raise SystemExit(0)
    return [float(len(response))]


def with_answer(prompts, responses, *, answer):
    return [float(r == str(a)) for r, a in zip(responses, answer)]


def pid(prompts, responses):
    return [float(os.getpid()) for _ in responses]

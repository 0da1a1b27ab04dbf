"""The suite's tiny models built in the background while the first tests run.

On a fresh cache the suite builds its offline models where a test first needs one, on one
thread (a trained model's bits must not depend on the threads), while the machine's other
core often idles: about 4 minutes on the 2-core machine, the arithmetic policy 2.5 of them.
``start`` runs this module as a process of its own at low priority; it builds them one by one
in the order the suite tends to need them. A test that needs a model under way waits for it
(cached_build's lock) instead of building it a second time, and a model already built is
only looked up. ``stop`` ends it with the session, done or not: a build it had not finished is
done by the test that needs it, as before.

    .venv/bin/python tests/model_prebuild.py     # what ``start`` runs
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

NICE = 19  # below the tests and Ray's workers (nice 15): it takes an idle core, not theirs


def builds() -> list:
    """(name, build) in the order the suite's tests tend to need them."""
    from cluster.demo import arithmetic, families, judge, pretrain, sentiment, tiny_models

    out = [("tokenizer", tiny_models.build_tokenizer), ("policy", pretrain.build_pretrained_policy),
           ("reward model", tiny_models.build_reward_model), ("random policy", tiny_models.build_policy),
           ("judge", judge.build_judge), ("arithmetic policy", arithmetic.build_arithmetic_policy),
           ("positive policy", lambda: pretrain.build_pretrained_policy(
               texts=sentiment.corpus(words=sentiment.POSITIVE_WORDS)))]
    for family in families.FAMILIES:
        out.append((f"{family} policy", lambda f=family: families.build_family_policy(f)))
    return out


def wanted(items) -> bool:
    """Whether a session's selected tests include one that runs services: neither a unit test
    nor skipped. A gpu-tier run without CUDA, as tests/test_gpu_check.py starts inside the
    suite, skips all of its tests: a prebuild of its own would overwrite the suite's log."""
    return any(not item.get_closest_marker("unit") and not item.get_closest_marker("skip") for item in items)


def start(log: Path) -> subprocess.Popen:
    """This module in a process (and process group) of its own, its output in ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[1])
    os.setpriority(os.PRIO_PROCESS, proc.pid, NICE)  # before its first build: the import takes seconds
    return proc


def stop(proc: subprocess.Popen) -> None:
    """Ends the prebuild and the build process it may have started."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def main() -> int:
    import time

    for name, build in builds():
        t0 = time.perf_counter()
        try:
            build()
        except Exception as e:  # noqa: BLE001 - the test that needs it builds it and reports
            print(f"prebuild: {name} failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"prebuild: {name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())

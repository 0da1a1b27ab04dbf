"""Run `python -m <entrypoint> ...` many times without paying the interpreter's imports each time.

A user-mistake case costs ~6 s as a fresh `python -m cluster.train`, nearly all of it importing
torch, transformers and Ray; the mistake itself is found in milliseconds. This server imports
those once, then forks a child per command: the child is a process of its own (its own exit
code, stdout and stderr files, environment; the repository root as working directory, as the
subprocess cases had) that runs the module as `__main__`, as `python -m` does, and exits the
way the interpreter would (exit handlers run; an uncaught exception prints its traceback and
exits 1). Nothing is computed before the fork, so no thread pool is copied into the children.
vLLM is not imported: no mistake case reaches it.

Used through `EntrypointServer` (see tests/conftest.py `entrypoints`); a handful of cases also run
as real subprocesses, which proves the two agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "numpy", "yaml", "ray", "tokenizers", "transformers", "transformers.models.auto.auto_factory",
           "transformers.models.auto.tokenization_auto", "transformers.models.auto.modeling_auto",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.gpt2.modeling_gpt2",
           "cluster.train", "cluster.sft", "cluster.reward_model", "cluster.config.ppo", "cluster.config.stages",
           "cluster.data.prompts", "cluster.runtime.loop.driver", "cluster.runtime.state.resume", "actors.reward",
           "actors.reference")


@dataclass
class Result:  # the fields of subprocess.CompletedProcess that the tests read
    returncode: int
    stdout: str
    stderr: str


def assert_one_line_error(result, run_dir: Path, message: str) -> None:
    """A user mistake as tether reports it: exit 2, no traceback, our one line last, and
    nothing in the run folder that could pass for a run."""
    lines = [ln.strip() for ln in result.stderr.splitlines() if ln.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines and lines[-1].startswith("tether: error: "), result.stderr[-2000:]
    assert [ln for ln in lines if "tether:" in ln] == [lines[-1]]  # one error line, nothing else of ours
    assert message in lines[-1]
    assert not run_dir.exists() or not any(run_dir.iterdir())


class EntrypointServer:
    """The test side: starts the server process, sends it one command at a time."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, __file__], cwd=REPO, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"entrypoint server did not start (said {ready!r}, exit {self.proc.poll()})")

    def run(self, module: str, args: list[str], env: dict | None = None, timeout: float = 300) -> Result:
        with tempfile.TemporaryDirectory() as d:
            request = {"module": module, "args": list(map(str, args)), "env": env or {}, "out": d,
                       "timeout": timeout}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
            out, err = (Path(d) / "stdout").read_text(), (Path(d) / "stderr").read_text()
        return Result(returncode=reply["returncode"], stdout=out, stderr=err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---------------------------------------------------------------- the server process
def _child(request: dict) -> None:
    """Become `python -m module args...` with stdout/stderr in files; never returns."""
    import runpy
    import traceback

    out = Path(request["out"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for key, value in request["env"].items():
        os.environ[key] = value
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry:
            sys.path.insert(0, entry)
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # as the interpreter treats it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback and exit 1, like python
        traceback.print_exc()
        code = 1
    import atexit
    atexit._run_exitfuncs()  # what the interpreter runs on its way out
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve() -> None:
    import importlib
    import signal
    import threading

    for name in PRELOAD:
        importlib.import_module(name)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        timer = threading.Timer(request["timeout"], os.kill, (pid, signal.SIGKILL))  # a hung case
        timer.start()
        status = os.waitpid(pid, 0)[1]
        timer.cancel()
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()

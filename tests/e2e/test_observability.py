"""Observability, live, the way a user sees it (one job run for the whole module).

A Ray head is started with the venv's `ray start` on loopback with token authentication on,
a short training job goes in through `ray job submit --working-dir .`, and while it runs we
watch it from the outside: the dashboard REST API (job status, named actors), the Prometheus
endpoint (`ray_tether_*`), the dashboard web UI in a real headless Chromium (logged in through
the UI's own token dialog), and afterwards the job log and the run folder.

Auth: the cluster gets a token of its own (a file under the test's temp dir, RAY_AUTH_TOKEN_PATH,
RAY_AUTH_MODE=token) so the test neither needs nor touches ~/.ray/auth_token. The `ray` CLI reads
the token from that env; REST calls send `Authorization: Bearer <token>`; the browser types the
token into the dashboard's "Authentication Token Required" dialog, which sets the HttpOnly
`ray-authentication-token` cookie.

Teardown stops only this cluster: SIGTERM to its `ray start --block` process (which drains and
stops its children), then SIGKILL to the process group it leads and to any leftover process whose
command line names this cluster's temp dir. `ray stop` is not used: it stops every Ray cluster on
the machine, including other people's.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
from browser import Chromium, find_chromium

from cluster.nodes.ports import held_port, wait_listening
from cluster.runtime.observe.metrics import METRICS

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY = BIN / "ray"
# The job's length: long enough for every actor to be seen alive and scraped; the slow tier's
# browser needs longer (it loads the dashboard's pages while the job runs).
STEPS, UI_STEPS = 4, 8
ACTORS = ("generator-0", "reference-0", "reward-0", "learner-0", "buffer-0")
EXCLUDES = [".venv", "runs", ".git", "*.egg-info", ".pytest_cache", ".hypothesis", "__pycache__", ".cache"]
# Submit -> terminal state: the job fails the test only when neither its state nor its metrics.jsonl
# moves on for this long (its start-up, or one of its steps, takes far less on any machine).
JOB_STALL_S = 300
# Export lags ~10 s, and Ray 2.60 drops a gauge series ~20 s after its last set (2 x
# metrics_report_interval_ms), so the metrics are scraped every 2 s while the job runs and
# only briefly after it ends.
METRICS_GRACE_S = 30
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
WANTED_METRICS = ("ray_tether_reward_mean", "ray_tether_kl_mean", "ray_tether_ppo_clip_frac",
                  "ray_tether_perf_sync_seconds", "ray_tether_generator_tokens_per_s",
                  "ray_tether_score_seconds")


def _strict_json(line: str):
    def reject(token):
        raise ValueError(f"non-standard JSON constant {token}")
    return json.loads(line, parse_constant=reject)


_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m["labels"] or ""))
        try:
            value = float(m["value"])
        except ValueError:
            continue
        out.setdefault(m["name"], []).append((labels, value))
    return out


@dataclass
class Live:
    tmp: Path
    dashboard: str
    metrics_url: str
    token: str
    env: dict
    submission_id: str
    run_dir: Path
    out: Path                                          # kept (pytest temp): screenshot, logs
    steps: int = STEPS                                 # the job's run.steps
    submit_output: str = ""
    unauthenticated_status: Optional[int] = None
    job: dict = field(default_factory=dict)            # last REST job info
    statuses: list = field(default_factory=list)       # distinct job states in order seen
    alive_while_running: set = field(default_factory=set)
    all_alive_at_once: bool = False
    actor_rows: dict = field(default_factory=dict)     # name -> last row from /api/v0/actors
    actor_errors: list = field(default_factory=list)
    series: dict = field(default_factory=dict)         # (name, labels) -> value, union of scrapes
    scrape_errors: list = field(default_factory=list)
    cli_status: str = ""
    job_logs: str = ""
    ui: dict = field(default_factory=dict)
    ui_error: Optional[str] = None
    ui_skip: Optional[str] = None
    timings: dict = field(default_factory=dict)
    scrapes: int = 0
    actors_up: threading.Event = field(default_factory=threading.Event)
    job_ended: threading.Event = field(default_factory=threading.Event)
    last_scrape: str = ""

    # ------------------------------------------------------------------ REST
    def get(self, path: str, *, auth: bool = True, timeout: float = 10.0):
        headers = {"Authorization": f"Bearer {self.token}"} if auth else {}
        req = urllib.request.Request(self.dashboard + path, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())

    def post(self, path: str, timeout: float = 10.0):
        req = urllib.request.Request(self.dashboard + path, method="POST", data=b"",
                                     headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status

    def ray(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        return subprocess.run([str(RAY), *args], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout)

    def actors(self) -> list[dict]:
        data = self.get("/api/v0/actors?limit=1000&detail=false&timeout=10", timeout=15)
        rows = data
        for key in ("data", "result", "result"):  # {"data": {"result": {"result": [...]}}}
            if isinstance(rows, dict):
                rows = rows.get(key, rows)
        if not isinstance(rows, list):
            raise AssertionError(f"unexpected /api/v0/actors answer: {str(data)[:300]}")
        return rows

    def scrape(self) -> dict:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            self.last_scrape = r.read().decode()
        parsed = parse_prometheus(self.last_scrape)
        self.scrapes += 1
        for name, samples in parsed.items():
            if name.startswith("ray_tether_"):
                for labels, value in samples:
                    self.series[(name, tuple(sorted(labels.items())))] = value
        return parsed

    def found(self, name: str, **tags) -> list[float]:
        return [v for (n, labels), v in self.series.items()
                if n == name and all(dict(labels).get(k) == t for k, t in tags.items())]

    def metrics_complete(self) -> bool:
        return (all(self.found(n) for n in WANTED_METRICS)
                and self.found("ray_tether_generator_tokens_per_s", pool="generator", replica="generator-0")
                and self.found("ray_tether_score_seconds", pool="reference"))


# ---------------------------------------------------------------------- the live setup

def _start_head(tmp: Path, env: dict, client_port: int) -> subprocess.Popen:
    """Every port is the OS's choice: 0, read back afterwards, and for the Ray Client server
    (Ray refuses 0 there) one the OS chose and the caller holds until the server has it."""
    log = open(tmp / "ray-start.log", "wb")
    cmd = [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--port=0",
           "--dashboard-host=127.0.0.1", "--dashboard-port=0", "--dashboard-agent-listen-port=0",
           f"--ray-client-server-port={client_port}", "--num-cpus=4", "--disable-usage-stats",
           f"--temp-dir={tmp / 'ray'}"]
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


# Run in a child process: the test process must not join this cluster as a driver.
_ADDRESSES = """
import json, logging, sys, ray
ctx = ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
ports = [n["MetricsExportPort"] for n in ray.nodes() if n["Alive"]]
print(json.dumps({"dashboard": ctx.dashboard_url, "metrics_port": ports[0]}))
"""


def _addresses(tmp: Path, env: dict, head: subprocess.Popen, timeout: float = 120) -> dict:
    """The dashboard's address and the metrics port, as the head chose them."""
    gcs_file, deadline = tmp / "ray" / "ray_current_cluster", time.monotonic() + timeout
    while not gcs_file.is_file() or not gcs_file.read_text().strip():  # written once the GCS is up
        if head.poll() is not None or time.monotonic() > deadline:
            log = (tmp / "ray-start.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"`ray start` did not bring up a GCS (exit {head.poll()}):\n{log}")
        time.sleep(0.2)
    out = subprocess.run([sys.executable, "-c", _ADDRESSES, gcs_file.read_text().strip()], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"could not read the head's addresses: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _start_live_head(tmp: Path, env: dict, token: str, run_root: Path):
    with held_port() as client_port:
        head = _start_head(tmp, env, client_port)
        try:
            found = _addresses(tmp, env, head)
            assert wait_listening(client_port, 120), "the head's Ray Client server never listened"
        except BaseException:
            _stop_head(head, tmp)
            raise
    try:
        live = Live(tmp=tmp, dashboard=f"http://{found['dashboard']}",
                    metrics_url=f"http://127.0.0.1:{found['metrics_port']}/metrics", token=token, env=env,
                    submission_id=f"tether-obs-{secrets.token_hex(4)}", run_dir=run_root / "runs" / "obs",
                    out=run_root)
        _wait_dashboard(live, head)
        return head, live
    except BaseException:
        _stop_head(head, tmp)
        raise


def _stop_head(head: subprocess.Popen, tmp: Path) -> None:
    """Stop this cluster only: graceful SIGTERM to `ray start --block`, then SIGKILL leftovers."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)  # drains the node, stops raylet/GCS/dashboard/workers
        try:
            # Nothing of the cluster is kept, so a drain (it can take tens of seconds) is cut
            # short: the process-group kill and the sweep below stop whatever is left.
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)  # the group `ray start` leads (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    head.wait(timeout=10)
    marker = str(tmp / "ray").encode()
    for _ in range(20):
        left = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker in (proc / "cmdline").read_bytes():
                    left.append(int(proc.name))
            except OSError:
                continue
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.5)


def _wait_dashboard(live: Live, head: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if head.poll() is not None:
            log = (live.tmp / "ray-start.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"`ray start` exited with {head.returncode}:\n{log}")
        try:
            live.get("/api/jobs/", timeout=5)
            return
        except (OSError, ValueError) as e:
            last = e
        time.sleep(1)
    raise RuntimeError(f"dashboard not up within {timeout}s: {last}")


def _login(browser, live: Live) -> None:
    """Log in the way a user does: the dashboard asks for the token in a dialog."""
    browser.navigate(live.dashboard + "/#/jobs")
    browser.wait_for_text(["Authentication Token Required"], timeout=30)
    browser.evaluate("document.querySelector('input[type=password]').focus()")
    browser.send("Input.insertText", text=live.token)
    browser.wait_for(lambda: browser.evaluate(
        "(() => { const b = [...document.querySelectorAll('button')]"
        ".find(e => e.textContent.trim() === 'Submit'); return !!b && !b.disabled; })()"),
        10, "the token dialog's Submit button stayed disabled")
    browser.evaluate("[...document.querySelectorAll('button')]"
                     ".find(e => e.textContent.trim() === 'Submit').click()")
    browser.wait_for(lambda: "Authentication Token Required" not in browser.text(), 30,
                     "the token dialog did not go away after Submit")
    cookies = browser.send("Network.getCookies").get("cookies", [])
    cookie = next((c for c in cookies if c["name"] == "ray-authentication-token"), None)
    live.ui["login"] = "token typed into the dashboard's Authentication Token dialog"
    live.ui["cookie_http_only"] = bool(cookie and cookie.get("httpOnly"))
    live.ui["cookie_set"] = bool(cookie and cookie.get("value") == live.token)


def _capture_job_page(browser, live: Live) -> None:
    """The job page while the job runs: its id, entrypoint and the actors it started."""
    url = f"{live.dashboard}/#/jobs/{live.submission_id}"
    live.ui["url"] = url
    live.ui["job_status_at_open"] = live.job.get("status")
    browser.navigate(url)
    try:
        browser.wait_for_text([live.submission_id, "python -m cluster.train", "Actor Table"], timeout=45)
        # The job page lists the job's actors in a collapsed "Actor Table" section: open it.
        live.ui["actor_table_opened"] = bool(browser.evaluate(
            "(() => { const t = [...document.querySelectorAll('body *')].filter("
            "e => e.textContent.trim() === 'Actor Table').pop();"  # the innermost: the <h4> title
            " if (!t) return false; t.click(); return true; })()"))
        browser.wait_for_text([live.submission_id, *ACTORS], timeout=45)
        time.sleep(1.0)  # let the table settle before the picture
    finally:
        try:
            shot = browser.screenshot(live.out / "dashboard-job.png")
            live.ui["screenshot"] = str(shot)
            live.ui["text"] = browser.text()
            live.ui["dom"] = browser.dom()
            (live.out / "dashboard-job.html").write_text(live.ui["dom"])
            m = re.search(r"\bStatus\s+(PENDING|RUNNING|SUCCEEDED|FAILED|STOPPED)\b", live.ui["text"])
            live.ui["status_in_page"] = m and m.group(1)
        except Exception as e:  # noqa: BLE001 - keep the first error
            live.ui_error = live.ui_error or f"screenshot: {type(e).__name__}: {e}"


def _browse(live: Live) -> None:
    """The browser's part, on its own thread so status/actor/metric polling never stalls:
    log in through the UI, wait until the job's actors are up, then capture the job page."""
    browser = None
    t0 = time.monotonic()
    try:
        browser = Chromium(user_data_dir=live.tmp / "chromium-profile")
        _login(browser, live)
        live.timings["ui_login_s"] = round(time.monotonic() - t0, 1)
        while not live.actors_up.wait(0.5):
            if live.job_ended.is_set():
                raise RuntimeError("the job ended before all its named actors were ALIVE")
        t0 = time.monotonic()
        _capture_job_page(browser, live)
    except Exception as e:  # noqa: BLE001 - reported by the UI test
        live.ui_error = live.ui_error or f"{type(e).__name__}: {e}"
    finally:
        live.timings["ui_capture_s"] = round(time.monotonic() - t0, 1)
        if browser is not None:
            browser.close()


def _observe(live: Live) -> None:
    """Poll job status, actors and Prometheus until the job ends (and metrics are in)."""
    t_submit = time.monotonic()
    next_scrape = 0.0
    ended_at = None
    progress, progress_at = None, t_submit
    while True:
        now = time.monotonic()
        if ended_at is None:
            if now - progress_at > JOB_STALL_S:
                raise AssertionError(f"the job made no progress for {JOB_STALL_S}s (state, metrics.jsonl lines: "
                                     f"{progress}); states {live.statuses}")
            try:
                live.job = live.get(f"/api/jobs/{live.submission_id}")
            except (OSError, ValueError) as e:
                live.actor_errors.append(f"job status: {e}")
            status = live.job.get("status")
            if (seen := (status, _lines_written(live.run_dir))) != progress:
                progress, progress_at = seen, now
            if status and (not live.statuses or live.statuses[-1] != status):
                live.statuses.append(status)
                live.timings[f"job_{status.lower()}_s"] = round(now - t_submit, 1)
            if status == "RUNNING":
                try:
                    rows = live.actors()
                    alive = set()
                    for row in rows:
                        if row.get("name") in ACTORS:
                            live.actor_rows[row["name"]] = row
                            if row.get("state") == "ALIVE":
                                alive.add(row["name"])
                    live.alive_while_running |= alive
                    if alive == set(ACTORS):
                        live.all_alive_at_once = True
                except (OSError, ValueError, AssertionError) as e:
                    live.actor_errors.append(f"actors: {e}")
                if live.all_alive_at_once:
                    live.actors_up.set()
            if status in TERMINAL:
                ended_at = now
                live.job_ended.set()
        if now >= next_scrape:
            next_scrape = now + 2
            try:
                live.scrape()
            except (OSError, ValueError) as e:
                live.scrape_errors.append(str(e))
        if ended_at is not None and (live.metrics_complete() or now - ended_at > METRICS_GRACE_S):
            return
        time.sleep(1)


def _lines_written(run_dir: Path) -> int:
    """The lines of the job's metrics.jsonl so far (0 before its run folder exists)."""
    try:
        return (run_dir / "metrics.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _write_summary(live: Live) -> None:
    """What the module saw, kept in pytest's temp dir for triage (plus the job log, last scrape)."""
    summary = {"submission_id": live.submission_id, "timings": live.timings, "states": live.statuses,
               "alive_while_running": sorted(live.alive_while_running),
               "actor_errors": live.actor_errors[-5:], "scrape_errors": live.scrape_errors[-5:],
               "ui_error": live.ui_error, "ui_skip": live.ui_skip,
               "ui": {k: v for k, v in live.ui.items() if k not in ("text", "dom")},
               "scrapes": live.scrapes, "ray_tether_series": len(live.series)}
    (live.out / "observations.json").write_text(json.dumps(summary, indent=1))
    (live.out / "job.log").write_text(live.job_logs)
    (live.out / "last-scrape.txt").write_text(live.last_scrape)
    print(f"\nobservability ({live.out}): {json.dumps(summary)}")


@pytest.fixture(scope="module")
def live(tmp_path_factory, request):
    if not RAY.exists():
        pytest.skip(f"no `ray` next to {sys.executable}")

    t_module = time.monotonic()
    run_root = tmp_path_factory.mktemp("obs")
    # Unix socket paths under --temp-dir are length-limited: keep that one short.
    tmp = Path(tempfile.mkdtemp(prefix="tobs-", dir="/tmp"))
    token_file = tmp / "auth_token"
    token = secrets.token_hex(16)
    token_file.write_text(token)
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS")}
    env.update(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=str(token_file), RAY_USAGE_STATS_ENABLED="0")
    try:
        head, live = _start_live_head(tmp, env, token, run_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    browse = None
    try:
        live.timings["head_up_s"] = round(time.monotonic() - t_module, 1)
        try:
            live.get("/api/jobs/", auth=False)
            live.unauthenticated_status = 200
        except urllib.error.HTTPError as e:
            live.unauthenticated_status = e.code

        ui_test = "test_dashboard_ui_shows_the_job_and_its_actors"
        ui_selected = any(item.name == ui_test for item in request.session.items)
        live.steps = UI_STEPS if ui_selected else STEPS
        sub = live.ray("job", "submit", "--address", live.dashboard,
                       "--submission-id", live.submission_id, "--working-dir", ".",
                       "--runtime-env-json", json.dumps({"excludes": EXCLUDES}), "--no-wait", "--",
                       "python", "-m", "cluster.train", f"run.steps={live.steps}",
                       f"run.dir={run_root / 'runs'}", "run.name=obs", f"run.eval_every={live.steps // 2}",
                       "run.samples_every=2")
        live.submit_output = sub.stdout + sub.stderr
        assert sub.returncode == 0, f"ray job submit failed:\n{live.submit_output}"
        live.timings["submitted_s"] = round(time.monotonic() - t_module, 1)

        if not ui_selected:
            live.ui_skip = f"{ui_test} is not selected (slow tier)"  # no browser competing for the cores
        elif find_chromium() is None:
            live.ui_skip = "no Chromium (scripts/setup.sh installs Debian's chromium with apt)"
        else:
            browse = threading.Thread(target=_browse, args=(live,), name="tether-obs-browser",
                                      daemon=True)
            browse.start()

        _observe(live)
        if browse is not None:
            browse.join(timeout=180)
            if browse.is_alive():
                live.ui_error = live.ui_error or "the browser thread did not finish within 180s"

        status = live.ray("job", "status", "--address", live.dashboard, live.submission_id)
        live.cli_status = status.stdout + status.stderr
        logs = live.ray("job", "logs", "--address", live.dashboard, live.submission_id)
        live.job_logs = logs.stdout + (f"\n[stderr]\n{logs.stderr}" if logs.returncode else "")
        live.timings["setup_s"] = round(time.monotonic() - t_module, 1)
        _write_summary(live)
        yield live
    finally:
        live.job_ended.set()  # releases the browser thread if we got here early
        if browse is not None and browse.is_alive():
            browse.join(timeout=90)
        if not (run_root / "observations.json").exists():
            _write_summary(live)
        if live.job.get("status") not in TERMINAL and head.poll() is None:
            try:
                live.post(f"/api/jobs/{live.submission_id}/stop")
            except OSError:
                pass
        _stop_head(head, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------- the checks

def test_token_auth_is_on(live):
    assert live.unauthenticated_status == 401, "the dashboard answered a request without a token"


def test_job_succeeds_with_a_progress_line_per_step(live):
    assert live.job.get("status") == "SUCCEEDED", (
        f"job {live.submission_id} ended {live.job.get('status')}: {live.job.get('message')}\n"
        f"log tail:\n{live.job_logs[-4000:]}")
    assert f"Job '{live.submission_id}' succeeded" in live.cli_status, live.cli_status
    assert live.job.get("entrypoint", "").startswith("python -m cluster.train")
    steps = live.steps
    for k in range(1, steps + 1):
        lines = [ln for ln in live.job_logs.splitlines() if f"step {k}/{steps} " in ln]
        assert len(lines) == 1, f"step {k}: expected one progress line, got {lines}"
        assert re.search(rf"step {k}/{steps} v{k} \| reward -?\d+\.\d{{3}}±\d+\.\d{{2}} \| "
                         rf"kl -?\d+\.\d{{3}} beta \d+\.\d{{3}} \|.* tok/s \| \d+\.\d+s \(gen ",
                         lines[0]), lines[0]
    assert "eta " in next(ln for ln in live.job_logs.splitlines() if f"step 1/{steps} " in ln)
    assert "tether: done; reward/mean=" in live.job_logs
    assert "Traceback" not in live.job_logs, live.job_logs[-4000:]


def test_prometheus_exports_the_project_metrics(live):
    missing = [n for n in WANTED_METRICS if not live.found(n)]
    assert not missing, (f"not exported at {live.metrics_url}: {missing}; seen "
                         f"{sorted({n for n, _ in live.series})}; errors {live.scrape_errors[-3:]}")
    for name in WANTED_METRICS:
        assert all(math.isfinite(v) for v in live.found(name)), name
    tps = live.found("ray_tether_generator_tokens_per_s", pool="generator", replica="generator-0")
    assert tps and max(tps) > 0, [k for k in live.series if "tokens_per_s" in k[0]]
    score = live.found("ray_tether_score_seconds", pool="reference")
    assert score and max(score) > 0, [k for k in live.series if "score_seconds" in k[0]]
    assert live.found("ray_tether_perf_sync_seconds")[0] >= 0
    unlisted = {n for n, _ in live.series} - {f"ray_{m}" for m in METRICS}
    assert not unlisted, f"exported but not listed in cluster.runtime.observe.metrics.METRICS: {unlisted}"


def test_dashboard_lists_the_named_actors_while_running(live):
    assert "RUNNING" in live.statuses, f"never saw the job RUNNING: {live.statuses}"
    assert live.all_alive_at_once, (
        f"named actors ALIVE while running: {sorted(live.alive_while_running)}, wanted {ACTORS}; "
        f"rows {({n: r.get('state') for n, r in live.actor_rows.items()})}; errors {live.actor_errors[-3:]}")
    classes = {n: r.get("class_name") for n, r in live.actor_rows.items()}
    assert classes["generator-0"] == "Generator" and classes["buffer-0"] == "RolloutBuffer", classes


def test_run_folder(live):
    run = live.run_dir
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "succeeded" and status["steps"] == live.steps, status
    nodes = status["nodes"]  # where each actor ran: all on this one-node cluster
    assert set(nodes) == set(ACTORS) and len({n["node_id"] for n in nodes.values()}) == 1, nodes
    rows = [_strict_json(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(live.steps + 1))
    assert "eval/score_mean" in rows[0]
    for r in rows[1:]:
        assert r["policy/version"] == r["step"]
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["kl/mean"])
        assert ("eval/score_mean" in r) == (r["step"] % (live.steps // 2) == 0), r["step"]
    samples = [_strict_json(ln) for ln in (run / "samples.jsonl").read_text().splitlines()]
    assert samples, "samples.jsonl is empty"
    assert {s["step"] for s in samples} == set(range(2, live.steps + 1, 2))
    assert all(isinstance(s["response"], str) and "score" in s for s in samples)
    for name in ("reward.png", "kl.png"):
        data = (run / "plots" / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", name
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 300 and height >= 200, (name, width, height)


# The slow tier: Chromium beside the job. The default tier watches the same job through REST and Prometheus:
# test_dashboard_lists_the_named_actors_while_running and test_prometheus_exports_the_project_metrics.
@pytest.mark.slow
def test_dashboard_ui_shows_the_job_and_its_actors(live):
    if live.ui_skip:
        pytest.skip(live.ui_skip)
    assert live.ui_error is None, live.ui_error + (f"\npage text:\n{live.ui.get('text', '')[:2000]}")
    assert live.ui.get("cookie_set") and live.ui.get("cookie_http_only"), live.ui
    shot = Path(live.ui["screenshot"]).read_bytes()
    assert shot[:8] == PNG_SIGNATURE and len(shot) > 20_000
    text, dom = live.ui["text"], live.ui["dom"]
    assert live.submission_id in text and "python -m cluster.train" in text
    for name in ACTORS:
        assert name in text and name in dom, name

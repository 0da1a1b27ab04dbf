"""A real headless Chromium for the e2e tests, driven over the DevTools protocol (CDP).

Only the standard library and `websockets` (a Ray dependency) are used; the browser is
Debian's `chromium` package (scripts/setup.sh installs it). One page per browser:

    with Chromium(user_data_dir=tmp) as b:
        b.navigate("http://127.0.0.1:8265/")
        b.wait_for_text("Jobs", timeout=20)
        b.screenshot(tmp / "page.png")
"""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Optional

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--no-default-browser-check", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--mute-audio")


def find_chromium() -> Optional[str]:
    for path in (os.environ.get("TETHER_CHROMIUM"), *CHROMIUM_CANDIDATES):
        if path and os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium process (its own process group) and a CDP session on its page."""

    def __init__(self, *, user_data_dir: Path, binary: Optional[str] = None,
                 window: tuple[int, int] = (1400, 1000), start_timeout: float = 60.0) -> None:
        from websockets.sync.client import connect

        binary = binary or find_chromium()
        if not binary:
            raise BrowserError("no Chromium binary (apt-get install chromium)")
        self.user_data_dir = Path(user_data_dir)
        self.user_data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.user_data_dir.parent / f"{self.user_data_dir.name}.chromium.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--window-size={window[0]},{window[1]}",
             f"--user-data-dir={self.user_data_dir}", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", "about:blank"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        self._ids = itertools.count(1)
        self.ws = None
        try:
            port = self._devtools_port(start_timeout)
            page = self._page_target(port, start_timeout)
            self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30,
                              close_timeout=5).__enter__()  # closed in close()
            self.send("Page.enable")
            self.send("Runtime.enable")
            self.send("Emulation.setDeviceMetricsOverride", width=window[0], height=window[1],
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _devtools_port(self, timeout: float) -> int:
        port_file = self.user_data_dir / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited with {self.proc.returncode}; see {self.log_path}")
            try:
                first = port_file.read_text().splitlines()[0]
                if first.strip():
                    return int(first)
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.2)
        raise BrowserError(f"chromium did not open its DevTools port within {timeout:.0f}s")

    @staticmethod
    def _page_target(port: int, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    pages = [t for t in json.load(r) if t.get("type") == "page"]
                if pages:
                    return pages[0]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BrowserError("chromium has no page target")
            time.sleep(0.2)

    # ------------------------------------------------------------------ protocol
    def send(self, method: str, timeout: float = 60.0, **params) -> dict:
        """One CDP command; events arriving meanwhile are dropped."""
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"CDP {method}: no answer within {timeout:.0f}s")
            msg = json.loads(self.ws.recv(timeout=left))
            if msg.get("id") != msg_id:
                continue
            if "error" in msg:
                raise BrowserError(f"CDP {method}: {msg['error']}")
            return msg.get("result", {})

    def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                        awaitPromise=await_promise)
        if "exceptionDetails" in res:
            details = res["exceptionDetails"]
            what = details.get("exception", {}).get("description") or details
            raise BrowserError(f"page script failed: {what}")
        return res.get("result", {}).get("value")

    # ------------------------------------------------------------------ page helpers
    def navigate(self, url: str, timeout: float = 30.0) -> None:
        res = self.send("Page.navigate", url=url)
        if res.get("errorText"):
            raise BrowserError(f"navigate {url}: {res['errorText']}")
        self.wait_for(lambda: self.evaluate("document.readyState") == "complete", timeout,
                      f"{url} did not finish loading")

    def reload(self, timeout: float = 30.0) -> None:
        self.send("Page.reload", ignoreCache=True)
        time.sleep(0.5)
        self.wait_for(lambda: self.evaluate("document.readyState") == "complete", timeout,
                      "page did not finish reloading")

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def dom(self) -> str:
        return self.evaluate("document.documentElement.outerHTML") or ""

    def wait_for_text(self, needles: Iterable[str], timeout: float) -> str:
        """Wait until the page's visible text holds every needle; return that text."""
        needles = list(needles)
        last = {"text": ""}

        def ready():
            last["text"] = self.text()
            return all(n in last["text"] for n in needles)

        self.wait_for(ready, timeout, lambda: "page text lacks "
                      f"{[n for n in needles if n not in last['text']]}; it reads:\n{last['text'][:1500]}")
        return last["text"]

    @staticmethod
    def wait_for(predicate, timeout: float, message) -> None:
        """Poll ``predicate`` until true; a page that is navigating (CDP errors) counts as not yet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return
                error = None
            except BrowserError as e:  # "Inspected target navigated or closed", no context yet
                error = e
            if time.monotonic() > deadline:
                text = message() if callable(message) else message
                raise BrowserError(text + (f" (last error: {error})" if error else ""))
            time.sleep(0.5)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        params: dict = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size["width"],
                                "height": min(size["height"], 6000), "scale": 1})
        data = base64.b64decode(self.send("Page.captureScreenshot", **params)["data"])
        path = Path(path)
        path.write_bytes(data)
        return path

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        if self.ws is not None:
            try:
                self.send("Browser.close", timeout=5)
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            try:
                self.ws.close()
            except Exception:  # noqa: BLE001
                pass
            self.ws = None
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        # Chromium's helpers (zygote, renderers) share the process group we gave it.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(0.3)
        self._log.close()

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

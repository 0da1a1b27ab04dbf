"""A reward server on loopback for tests: a real HTTP server in a thread of the test process.

``http.server.ThreadingHTTPServer(("127.0.0.1", 0))`` binds and listens in its constructor, so it
takes connections (they wait in the backlog) before its thread serves them: no readiness race,
no fixed port. ``reply(index, body)`` decides each answer; it may block on ``release`` (set when
the server closes) to stand for a server that does not answer.
"""
from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Reply = tuple[int, str]  # (HTTP status, body)


def rewards_by_length(body: dict) -> Reply:
    """A healthy server: one reward per pair, the response's length in characters."""
    return 200, json.dumps({"rewards": [float(len(r)) for r in body["responses"]], "extra_logs": {}})


class RewardServer:
    """Serve POSTs at ``self.url`` with ``reply(index, body) -> (status, text)``; ``self.bodies``
    keeps every request's JSON body, in arrival order."""

    def __init__(self, reply: Callable[[int, dict], Reply] = lambda i, body: rewards_by_length(body)):
        self.reply, self.bodies, self.lock = reply, [], threading.Lock()
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the name http.server calls
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    index = len(server.bodies)
                    server.bodies.append(body)
                status, text = server.reply(index, body)
                data = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up on this request (its timeout): nothing to answer
                    pass

            def log_message(self, *args):  # keep the test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def hang(self) -> Reply:
        """For ``reply``: answer only when the server closes (a server that stopped answering)."""
        self.release.wait()
        return 503, "{}"

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "RewardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ClosedPort:
    """A loopback port bound but not listening, held while in use: a connection is refused
    (a server that is down), and no other process can take the port meanwhile."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/get_reward"

    def __enter__(self) -> "ClosedPort":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

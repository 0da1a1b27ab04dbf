"""A port the OS chooses for a server that needs a number: held, not bound and released.

Ray's head needs a number for its Ray Client server (it refuses 0). Picking a free port by
binding it and letting go leaves a window in which anything else may take it. Instead the
port is bound here with SO_REUSEPORT and held (never listened on) until the server is up:
meanwhile no other socket can bind it, except one that also sets SO_REUSEPORT from this
user, which gRPC servers (Ray's client server among them) do by default. Once the server
listens, this socket is closed and the port is the server's alone.
"""
from __future__ import annotations

import contextlib
import socket
import time
from typing import Iterator


@contextlib.contextmanager
def held_port(host: str = "0.0.0.0") -> Iterator[int]:  # noqa: S104 - every address, as the server binds
    """A port of the OS's choice, reserved for this block; free it once the server has it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, 0))
        yield sock.getsockname()[1]


def wait_listening(port: int, timeout_s: float, host: str = "127.0.0.1") -> bool:
    """Whether a server accepts connections on ``port`` within ``timeout_s`` (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)

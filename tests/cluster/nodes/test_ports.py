"""A port the OS chose, held for a server that needs a number (cluster/nodes/ports.py)."""
import errno
import socket

import pytest

from cluster.nodes.ports import held_port, wait_listening

pytestmark = pytest.mark.unit


def test_a_held_port_refuses_other_binds_and_takes_a_reuseport_server():
    with held_port() as port:
        assert port > 0
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        assert not wait_listening(port, timeout_s=0.0)  # held, never listened on
        with socket.socket() as server:  # as a gRPC server binds: SO_REUSEPORT, same user
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            assert wait_listening(port, timeout_s=5.0)

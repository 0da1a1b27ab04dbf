"""Where the learner ranks meet: the torch.distributed store, its address, the process group.

No port is ever chosen by binding a socket, closing it and binding it again later: in
between, another process can take it (CI failed at random with EADDRINUSE). Rank 0
opens the TCPStore on port 0 instead, so the OS picks a free port and the store holds
it from that moment; the other ranks connect to that (address, port) as clients.

Every rank's gloo traffic goes out on the interface holding its node's address (as Ray knows
it): left alone, gloo binds the address the machine's hostname resolves to, often 127.0.0.1
(or 127.0.1.1), which the other nodes reach as their own loopback, so a group whose ranks are
on different machines hangs until ``dist_timeout_s``.
"""
from __future__ import annotations

import datetime
import errno
import os
import random
import socket
from dataclasses import dataclass
from typing import Optional

import psutil
import torch
import torch.distributed as dist

from core.infra.errors import type_and_first_line


class RendezvousError(RuntimeError):
    """A rank could not join the process group (store unreachable, peer missing, timeout)."""


@dataclass(frozen=True)
class StoreAddress:
    """Where rank 0's TCPStore listens."""
    host: str
    port: int


def node_ip() -> str:
    """This node's IP as Ray sees it (reachable from the other nodes); loopback outside Ray."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def open_store(world_size: int, timeout_s: float) -> tuple[dist.TCPStore, StoreAddress]:
    """Rank 0's store server on a port the OS picks, held until the store is dropped.

    Returns at once (``wait_for_workers=False``): the others need the address first.
    """
    host = node_ip()
    store = dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, StoreAddress(host, int(store.port))


def interface_of(ip: str) -> Optional[str]:
    """The name of the network interface (of this process's network namespace) holding ``ip``."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            return name
    return None


def use_node_interface(ip: str) -> None:
    """Have gloo bind the interface holding ``ip`` (this node's address), unless the user chose
    one (GLOO_SOCKET_IFNAME). Read when a gloo group is created: set before the first."""
    name = interface_of(ip)
    if name is not None and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = name


def join_process_group(rank: int, world_size: int, address: Optional[StoreAddress], timeout_s: float,
                       store: Optional[dist.Store] = None, own_ip: Optional[str] = None) -> str:
    """Join the default torch.distributed group through rank 0's store; returns the backend.

    ``store``: rank 0 passes the one it opened; the others connect to ``address``. A
    process already in a group (in-process tests) reuses it. ``own_ip``: this rank's node's
    address, which gloo binds (default: Ray's node address). The timeout also bounds every
    later collective, so a dead peer becomes an error instead of a hang.
    """
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"learner: process already in a group as rank {dist.get_rank()}/"
                               f"{dist.get_world_size()}, asked to be {rank}/{world_size}")
        return dist.get_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        use_node_interface(own_ip or node_ip())
    try:
        if store is None:
            store = dist.TCPStore(address.host, address.port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - any failure here is a failed rendezvous
        where = f"{address.host}:{address.port}" if address else "its own store"
        raise RendezvousError(f"learner rank {rank}/{world_size} could not join at {where}: "
                              f"{type_and_first_line(e)}") from e
    # DeepSpeed reads these for its bookkeeping (it does not rendezvous itself: the group
    # exists); Ray gives each GPU actor one device, hence LOCAL_RANK 0.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if address is not None:
        os.environ.update(MASTER_ADDR=address.host, MASTER_PORT=str(address.port))
    return backend


# ------------------------------------------------------------------ ports bound by someone else


def candidate_port() -> int:
    """A port for a server that code outside ours binds (vLLM's StatelessProcessGroup).

    Drawn at random below Linux's ephemeral range (32768+), where the OS assigns the
    local ports of outgoing connections. It may be taken: callers retry on
    ``is_address_in_use`` with a fresh one.
    """
    return random.SystemRandom().randrange(20000, 32768)


def is_address_in_use(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a failed bind: EADDRINUSE."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
            return True
        text = str(error)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            return True
        error = error.__cause__ or error.__context__
    return False

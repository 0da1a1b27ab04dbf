"""Worker nodes with addresses of their own on this machine: Linux network namespaces on a bridge.

``tether cluster up --netns`` gives each worker node's raylet its own network stack: a
namespace (``tether-<tag>-w<i>``) holding one end of a veth pair (``eth0``, an address of
the bridge's subnet, and its own loopback), the other end (``tv<tag>w<i>``) on a bridge
(``tb-<tag>``) whose own address is the head's. Traffic between nodes is then real TCP between
distinct addresses, as between machines: nothing reaches a node through 127.0.0.1, and a port
taken on one node is free on another. No default route is set in a namespace and the host does
not forward: nothing outside the machine is addressed.

The subnet is a private /24 (10.x.y.0/24) that no address or route of this machine overlaps,
checked when it is chosen. ``Net`` records every name before it is made, so ``remove`` undoes a
partial ``create`` or one a crash interrupted; each of its steps ignores what is already gone,
so it can run any number of times. ``cut``/``restore`` take a node's link down and up (its
bridge-side veth): a network partition of that node, its processes untouched.
"""
from __future__ import annotations

import ipaddress
import json
import os
import random
import shutil
import subprocess
from dataclasses import asdict, dataclass, field

from core.infra.errors import UserError

PREFIX = "tether-"          # every namespace this module makes starts so
IP_TIMEOUT_S = 30.0         # one `ip` call


class NetnsError(UserError):
    """Namespaces cannot be made here, or a step of making them failed: one line, exit code 2."""


@dataclass
class Net:
    """The bridge, its subnet and each worker node's namespace, veth and address, by node name."""
    tag: str
    subnet: str
    bridge: str
    host_ip: str
    nodes: dict[str, dict] = field(default_factory=dict)   # "worker-1" -> {"netns", "veth", "ip"}

    def node(self, name: str) -> dict:
        if name not in self.nodes:
            raise NetnsError(f"{name!r} has no namespace of this cluster; its nodes: {', '.join(self.nodes)}")
        return self.nodes[name]


def as_dict(net: Net | None) -> dict | None:
    return None if net is None else asdict(net)


def from_dict(data: dict | None) -> Net | None:
    return None if data is None else Net(**data)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        said = (result.stderr or result.stdout).strip() or f"exit {result.returncode}"
        raise NetnsError(f"`ip {' '.join(args)}` failed: {said}")
    return result


def check_available() -> None:
    """Refuse in one line where namespaces cannot be made: not root, no `ip`, or no netns support."""
    if os.geteuid() != 0:
        raise NetnsError("--netns makes network namespaces and a bridge, which needs root; run as root, "
                         "or leave out --netns (the nodes then share this machine's address)")
    if shutil.which("ip") is None:
        raise NetnsError("--netns needs the `ip` command (iproute2); install it, or leave out --netns")
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        raise NetnsError(f"network namespaces are unavailable here (`ip netns add` said: {made.stderr.strip()}); "
                         "leave out --netns")


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to (the default route aside)."""
    nets = []
    for link in json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default" and ":" not in dst:
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return nets


def free_subnet(used: list[ipaddress.IPv4Network], rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 overlapping none of ``used``; tried from a random start so that two
    clusters made at once are unlikely to pick the same one (``create`` fails on a clash)."""
    rng = rng or random.SystemRandom()
    start = rng.randrange(1 << 16)
    for k in range(1 << 16):
        n = (start + k) % (1 << 16)
        candidate = ipaddress.ip_network(f"10.{n >> 8}.{n & 255}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise NetnsError("no free 10.x.y.0/24 subnet on this machine for the cluster's bridge")


def plan(n_workers: int, subnet: ipaddress.IPv4Network, tag: str | None = None) -> Net:
    """Names and addresses for a bridge and ``n_workers`` namespaces; nothing is made."""
    tag = tag or f"{random.SystemRandom().getrandbits(24):06x}"
    hosts = subnet.hosts()
    net = Net(tag=tag, subnet=str(subnet), bridge=f"tb-{tag}", host_ip=str(next(hosts)))
    for i in range(1, n_workers + 1):
        add_node(net, f"worker-{i}")
    return net


def add_node(net: Net, name: str) -> dict:
    """Plan one more node's namespace, veth and address (the next free one); nothing is made."""
    taken = {net.host_ip, *(n["ip"] for n in net.nodes.values())}
    ip = next(str(h) for h in ipaddress.ip_network(net.subnet).hosts() if str(h) not in taken)
    index = int(ip.rsplit(".", 1)[1])
    net.nodes[name] = {"netns": f"{PREFIX}{net.tag}-{name}", "veth": f"tv{net.tag}n{index}", "ip": ip}
    return net.nodes[name]


def create_bridge(net: Net) -> None:
    prefix = ipaddress.ip_network(net.subnet).prefixlen
    _ip("link", "add", net.bridge, "type", "bridge")
    _ip("addr", "add", f"{net.host_ip}/{prefix}", "dev", net.bridge)
    _ip("link", "set", net.bridge, "up")


def create_node(net: Net, name: str) -> None:
    """The node's namespace, its loopback up, and a veth from the bridge to its ``eth0``."""
    node, prefix = net.nodes[name], ipaddress.ip_network(net.subnet).prefixlen
    peer = f"{node['veth']}p"
    _ip("netns", "add", node["netns"])
    _ip("-n", node["netns"], "link", "set", "lo", "up")
    _ip("link", "add", node["veth"], "type", "veth", "peer", "name", peer)
    _ip("link", "set", peer, "netns", node["netns"])
    _ip("-n", node["netns"], "link", "set", peer, "name", "eth0")
    _ip("-n", node["netns"], "addr", "add", f"{node['ip']}/{prefix}", "dev", "eth0")
    _ip("-n", node["netns"], "link", "set", "eth0", "up")
    _ip("link", "set", node["veth"], "master", net.bridge, "up")


def create(net: Net) -> None:
    """Make the bridge and every node's namespace (``remove`` undoes any part of it)."""
    create_bridge(net)
    for name in net.nodes:
        create_node(net, name)


def remove_node(net: Net, name: str) -> None:
    """Delete the node's namespace (its eth0 and so the veth pair go with it) and its bridge end."""
    node = net.nodes[name]
    _ip("netns", "del", node["netns"], check=False)
    _ip("link", "del", node["veth"], check=False)


def remove(net: Net) -> None:
    """Delete everything ``net`` names; what is already gone is skipped. A namespace whose
    processes still run is deleted too: they keep only a stack cut off from everything."""
    for name in net.nodes:
        remove_node(net, name)
    _ip("link", "del", net.bridge, check=False)


def leftovers(net: Net) -> list[str]:
    """What of ``net`` still exists: namespaces and links by name."""
    namespaces = set(_ip("netns", "list", check=False).stdout.split())
    links = {link["ifname"] for link in json.loads(_ip("-j", "link", "show", check=False).stdout or "[]")}
    left = [n["netns"] for n in net.nodes.values() if n["netns"] in namespaces]
    left += [n["veth"] for n in net.nodes.values() if n["veth"] in links]
    return left + ([net.bridge] if net.bridge in links else [])


def pids(net: Net) -> list[int]:
    """Every process running in one of ``net``'s namespaces (a partial start's too)."""
    found = []
    for node in net.nodes.values():
        out = _ip("netns", "pids", node["netns"], check=False).stdout
        found += [int(pid) for pid in out.split() if pid.isdigit()]
    return found


# Settings that name the host's own network (its interfaces, its address): a namespace has none of
# them (its interfaces are lo and the veth end, found by the node's address), so its processes
# must choose their own (learner/rendezvous.py, core/modeling/vllm_engine.py).
HOST_NETWORK_KEYS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "VLLM_HOST_IP")


def node_env(env: dict) -> dict:
    """``env`` for a process started in a node's namespace: the host's network choices left out."""
    return {k: v for k, v in env.items() if k not in HOST_NETWORK_KEYS}


def exec_prefix(net: Net, name: str) -> list[str]:
    """The command prefix that runs a program inside the node's namespace."""
    return ["ip", "netns", "exec", net.node(name)["netns"]]


def cut(net: Net, name: str) -> None:
    """Partition the node: its bridge-side link down. Its processes run on, unreachable."""
    _ip("link", "set", net.node(name)["veth"], "down")


def restore(net: Net, name: str) -> None:
    """End the node's partition: its bridge-side link up (and on the bridge) again."""
    _ip("link", "set", net.node(name)["veth"], "master", net.bridge, "up")

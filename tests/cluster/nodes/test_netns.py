"""Worker nodes with addresses of their own (cluster/nodes/netns.py): a bridge and namespaces
made and removed (also after a partial start, and twice), a node's link cut and restored, and
two learner ranks in different namespaces joining one gloo group over their own addresses.

The namespaced tests need root and `ip netns`; they skip elsewhere. Each removes what it made
in a finalizer and checks nothing of it is left.
"""
from __future__ import annotations

import ipaddress
import os
import random
import subprocess
import sys
import textwrap
import types

import pytest

from cluster import local_cluster
from cluster.nodes import netns

# ------------------------------------------------------------------------------ pure


@pytest.mark.unit
def test_the_subnet_overlaps_nothing_used_and_names_fit_linux():
    used = [ipaddress.ip_network("10.0.0.0/9"), ipaddress.ip_network("10.200.3.0/24"),
            ipaddress.ip_network("10.128.0.7/32")]
    for seed in range(50):
        subnet = netns.free_subnet(used, random.Random(seed))
        assert subnet.prefixlen == 24 and subnet.subnet_of(ipaddress.ip_network("10.0.0.0/8"))
        assert not any(subnet.overlaps(u) for u in used), subnet
    with pytest.raises(netns.NetnsError, match="no free"):
        netns.free_subnet([ipaddress.ip_network("10.0.0.0/8")])
    net = netns.plan(12, ipaddress.ip_network("10.9.8.0/24"), tag="a1b2c3")
    netns.add_node(net, "spare")
    assert net.host_ip == "10.9.8.1" and net.nodes["spare"]["ip"] == "10.9.8.14"
    ips = [n["ip"] for n in net.nodes.values()]
    assert len(set(ips)) == 13 and net.host_ip not in ips
    links = [net.bridge, *(n["veth"] for n in net.nodes.values()), *(n["veth"] + "p" for n in net.nodes.values())]
    assert max(map(len, links)) <= 15 and len(set(links)) == len(links)  # IFNAMSIZ
    assert netns.from_dict(netns.as_dict(net)) == net
    with pytest.raises(netns.NetnsError, match="worker-1"):
        net.node("worker-99")


@pytest.mark.unit
def test_a_namespaced_raylet_gets_none_of_the_hosts_network_choices(monkeypatch, tmp_path):
    """GLOO_SOCKET_IFNAME=lo in the caller's environment (a host setting, or a learner rank built
    earlier in this process) would bind a namespaced rank to its own loopback, unreachable from
    the other nodes; the namespace's processes choose by their node's address instead."""
    from cluster.nodes import local

    started = {}

    def start(args, log, env, prefix=()):
        started.update(env=env, prefix=prefix)
        return types.SimpleNamespace(pid=0)  # what start_worker reads of the process
    monkeypatch.setattr(local, "_start", start)
    monkeypatch.setattr(local, "_finish", lambda *a: None)
    net = netns.plan(1, ipaddress.ip_network("10.99.0.0/24"))
    state = local.State(temp_dir=str(tmp_path), gcs_address="10.99.0.1:6379", dashboard_url="", head_id="",
                        started_at=0.0, workdir=str(tmp_path), net=netns.as_dict(net))
    env = {"PATH": "/bin", "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "192.0.2.1", "KEEP": "1"}
    local.start_worker(state, "worker-1", 1, {}, env)
    assert started["prefix"] and not set(started["env"]) & set(netns.HOST_NETWORK_KEYS)
    assert started["env"]["KEEP"] == "1"


@pytest.mark.unit
def test_up_netns_refuses_in_one_line_without_root_or_namespaces(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # main sets it; restored after the test
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert local_cluster.main(["up", "--netns"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs root" in err[0] and "--netns" in err[0], err
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "_ip", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "Operation not permitted"))
    assert local_cluster.main(["up", "--netns"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "namespaces are unavailable" in err[0] and "Operation not permitted" in err[0], err
    assert list(tmp_path.iterdir()) == []  # refused before anything was made or recorded


# ------------------------------------------------------------------------------ namespaces


@pytest.fixture
def made():
    """Nets the test makes; each removed after it, and checked gone. Skips without namespaces."""
    try:
        netns.check_available()
    except netns.NetnsError as e:
        pytest.skip(f"no network namespaces here: {e}")
    nets = []

    def make(n_workers: int, *, create: bool = True) -> netns.Net:
        nets.append(netns.plan(n_workers, netns.free_subnet(netns.used_networks())))
        if create:
            netns.create(nets[-1])
        return nets[-1]

    yield make
    for net in nets:
        netns.remove(net)
    assert [left for net in nets for left in netns.leftovers(net)] == []


def in_namespace(net: netns.Net, name: str, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([*netns.exec_prefix(net, name), sys.executable, "-c", textwrap.dedent(code), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


REACH = """
import sys
from cluster.nodes.ports import wait_listening
sys.exit(0 if wait_listening(int(sys.argv[2]), float(sys.argv[3]), host=sys.argv[1]) else 1)
"""
LISTEN = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
sys.stdin.read()
"""


def reaches(net, name: str, host: str, port: int, timeout_s: float) -> bool:
    return in_namespace(net, name, REACH, host, str(port), str(timeout_s)).wait(timeout=timeout_s + 60) == 0


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_nodes_reach_each_other_by_their_own_addresses_until_cut(made):
    net = made(2)
    assert sorted(netns.leftovers(net)) == sorted([net.bridge, *(n[k] for n in net.nodes.values()
                                                                 for k in ("netns", "veth"))])
    w2 = net.nodes["worker-2"]["ip"]
    server = subprocess.Popen([*netns.exec_prefix(net, "worker-2"), sys.executable, "-c", LISTEN, w2],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        assert reaches(net, "worker-1", w2, port, 10)
        assert not reaches(net, "worker-1", "127.0.0.1", port, 0)  # its loopback is its own
        netns.cut(net, "worker-2")
        assert not reaches(net, "worker-1", w2, port, 1)
        netns.restore(net, "worker-2")
        assert reaches(net, "worker-1", w2, port, 10)
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    assert server.pid not in netns.pids(net)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_remove_undoes_a_partial_create_and_can_run_again(made):
    net = made(3, create=False)
    netns.create_bridge(net)
    netns.create_node(net, "worker-1")  # a start that crashed here: worker-2 and -3 never made
    assert len(netns.leftovers(net)) == 3
    netns.remove(net)
    assert netns.leftovers(net) == []
    netns.remove(net)  # again: nothing to do, no error
    assert netns.leftovers(net) == []


# ------------------------------------------------------------------------------ gloo across nodes

RANK = """
import datetime, sys
import torch, torch.distributed as dist
from learner.rendezvous import StoreAddress, join_process_group
rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = dist.TCPStore(host, port, 2, is_master=rank == 0, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=20))
print(store.port, flush=True)  # rank 0's: the OS chose it
join_process_group(rank, 2, StoreAddress(host, store.port), 20.0, store=store, own_ip=sys.argv[4])
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(t.item(), flush=True)
"""


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_two_ranks_on_different_nodes_all_reduce_over_their_own_addresses(made):
    """The ranks' hostname resolves to 127.0.0.1 here (as on many machines): gloo left to it
    binds loopback, and the ranks, on different nodes, never connect."""
    net = made(2)
    host = net.nodes["worker-1"]["ip"]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}  # the user chose none
    rank0 = in_namespace(net, "worker-1", RANK, "0", host, "0", host, env=env)
    port = rank0.stdout.readline().strip()
    assert port.isdigit(), rank0.communicate(timeout=60)[1][-2000:]
    rank1 = in_namespace(net, "worker-2", RANK, "1", host, port, net.nodes["worker-2"]["ip"], env=env)
    outs = [p.communicate(timeout=120) for p in (rank0, rank1)]
    assert [rank0.returncode, rank1.returncode] == [0, 0], [err[-2000:] for _, err in outs]
    assert [float(out.split()[-1]) for out, _ in outs] == [3.0, 3.0]

"""A multi-node Ray cluster on this machine to try tether on: `tether cluster <subcommand>`

`up` starts a head (no CPUs: the job's driver) and worker nodes (the actors), each its own
raylet and object store, with this environment's `ray start`; the OS picks the ports (all
but the Ray Client server's: --client-port).
It records what it started in ./.tether-cluster.json; `status` lists the nodes and the
`ray job submit` command for this cluster; `kill-node` SIGKILLs one worker node whole, to watch
a job survive it; `down` stops exactly what `up` started (never `ray stop`, which would stop
every Ray on the machine). With `up --netns` each worker node has a network namespace and
an address of its own on a bridge `up` makes (root only); `cut-link` and `restore-link` then
partition a node from the others and end the partition, and `down` removes every namespace,
link and address it made. Exit 0 on success, 2 on a mistake (one line on stderr).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from cluster.job.errors import EXIT_DONE, EXIT_FAILED, exit_status, report
from cluster.nodes import local
from core.infra.errors import UserError, one_line

PROG = "tether cluster"


class _Mistake(UserError):
    """A bad command line, reported in one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise _Mistake(f"{message} ({self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):
        try:
            return super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:  # raised as such where exit_on_error is off
            raise _Mistake(str(e)) from None


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    ap = _Parser(prog=prog, description=__doc__, exit_on_error=False,
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Each subcommand has its own --help. The record lives in the current directory: "
                        "run every subcommand from the same one (the repository root).")
    sub = ap.add_subparsers(dest="command", metavar="{up,status,down,kill-node,cut-link,restore-link}",
                            parser_class=_Parser)
    sub.required = True
    up = sub.add_parser("up", help="start a head and worker nodes", description=(
        "Start a head node (0 CPUs) and --workers worker nodes, each its own raylet and object store, "
        "labelled tether.node=worker-<i>; print the nodes and the `ray job submit` command."))
    up.add_argument("--workers", type=int, default=2, metavar="N", help="worker nodes (default 2)")
    up.add_argument("--cpus-per-worker", type=int, nargs="+", default=[2], metavar="C",
                    help="logical CPUs of each worker node: one value for all, or one per worker (default 2; "
                         "the default job needs 4 in all, plus one node's worth to survive a node's loss)")
    up.add_argument("--labels-per-worker", nargs="+", default=[""], metavar="K=V[,K=V]",
                    help="extra node labels: one set for all workers, or one per worker, in order "
                         "(e.g. tether.pool=gen tether.pool=score); pools pick nodes by label with "
                         "<pool>.node_labels")
    up.add_argument("--client-port", type=int, default=None, metavar="PORT",
                    help="the head's Ray Client server port (default: one the OS chooses)")
    up.add_argument("--netns", action="store_true",
                    help="run each worker node in a network namespace of its own, with its own address on "
                         "a bridge this command makes (a free 10.x.y.0/24; the head on the bridge's address); "
                         "needs root")
    status = sub.add_parser("status", help="list the nodes and the job submit command",
                            description="List the cluster's nodes (id, name, labels, CPUs, alive) and print "
                                        "the `ray job submit` command for it.")
    status.add_argument("--json", action="store_true", help="print the record and the nodes as JSON")
    sub.add_parser("down", help="stop exactly what `up` started", description=(
        "Stop the processes of the recorded cluster only, found by node id: SIGTERM, then SIGKILL "
        "after a few seconds; forget the record. Other Ray clusters on this machine are left alone."))
    kill = sub.add_parser("kill-node", help="SIGKILL one worker node (raylet and all it started)",
                          description="SIGKILL one worker node whole, as a machine lost: its raylet and "
                                      "every process it started. Ray declares it dead within ~3 s.")
    kill.add_argument("node", help="the node's name (worker-2), id or a unique prefix of its id")
    for name, what in (("cut-link", "take a worker node's link down: a network partition (--netns)"),
                       ("restore-link", "bring a cut worker node's link up again (--netns)")):
        link = sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + (
            ". Its processes run on; a node cut longer than Ray's failure detection (~6 s for a cut node) is declared "
            "dead, and on its return its raylet exits."))
        link.add_argument("node", help="the node's name (worker-2), id or a unique prefix of its id")
    return ap


def main(argv=None, *, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ["RAY_AUTH_MODE"] = "token"  # before anything imports Ray: its clients need the token
    try:
        args = parser(prog).parse_args(argv)
        return COMMANDS[args.command](args, Path.cwd() / local.STATE_FILE)
    except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - one line, not a traceback
        return _report(e)


def _report(e: BaseException) -> int:
    """``tether: <line>`` for ``e``, with the exit code that exit_status decides; a failure says
    ``failed:`` as no run folder holds a traceback to point at."""
    code, line = exit_status(e)
    if code == EXIT_FAILED:
        line = f"failed: {one_line(e)}"
    return report(line, code)


def _per_worker(values: list, n: int, what: str) -> list:
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise _Mistake(f"{len(values)} values for {what}, but {n} workers: give one, or one per worker")
    return values


def cmd_up(args, path: Path) -> int:
    recorded = local.load(path)
    if recorded is not None and local.running(recorded):
        raise _Mistake(f"a cluster recorded in {path} is still up; stop it first with `tether cluster down`")
    if args.workers < 1 or (args.client_port is not None and not 1024 <= args.client_port <= 65535):
        raise _Mistake("--workers must be >= 1 and --client-port within 1024..65535")
    cpus = _per_worker(args.cpus_per_worker, args.workers, "--cpus-per-worker")
    if min(cpus) < 1:
        raise _Mistake("--cpus-per-worker must be >= 1")
    labels = [local.parse_labels(s) for s in _per_worker(args.labels_per_worker, args.workers, "--labels-per-worker")]
    where = " in network namespaces of their own" if args.netns else ""
    print(f"tether: starting a head and {args.workers} worker node(s){where} ...", flush=True)
    try:  # recorded as it grows: a crash mid-way leaves what `down` needs to remove it
        state = local.up(cpus, labels, client_port=args.client_port, workdir=path.parent, use_netns=args.netns,
                         record=lambda s: local.save(s, path))
    except BaseException:
        path.unlink(missing_ok=True)  # up removed what it had made
        raise
    print(f"tether: cluster up; recorded in {path}")
    return _print_status(state)


def cmd_status(args, path: Path) -> int:
    state = _recorded(path)
    if args.json:
        print(json.dumps({**dataclasses.asdict(state), "nodes": local.nodes(state),
                          "submit": local.submit_command(state)}, indent=1))
        return EXIT_DONE
    return _print_status(state)


def _print_status(state) -> int:
    rows = local.nodes(state)
    print(f"\n{'node':<10} {'id':<56}  {'address':<15} {'CPUs':>4}  {'alive':<5}  labels")
    for r in rows:
        labels = ",".join(f"{k}={v}" for k, v in r["labels"].items())
        print(f"{r['name']:<10} {r['id']:<56}  {r['ip']:<15} {r['cpus']:>4g}  {'yes' if r['alive'] else 'NO':<5}  "
              f"{labels}")
    print(f"\ndashboard: {state.dashboard_url} (token: ~/.ray/auth_token)   GCS: {state.gcs_address}")
    if state.client_port:
        print(f"Ray Client: ray://{state.gcs_address.rsplit(':', 1)[0]}:{state.client_port}")
    print(f"Ray's logs: {state.temp_dir}/session_latest/logs")
    print("\nsubmit the default job (from this directory; its run folder lands in ./runs):\n")
    print(local.submit_command(state))
    return EXIT_DONE


def cmd_down(args, path: Path) -> int:
    state = local.load(path)
    if state is None:  # a second down, or one after a failed up: nothing of ours is left
        print(f"tether: no cluster is recorded here ({path}); nothing to stop")
        return EXIT_DONE
    pids = local.stop(state)
    if local.running(state):  # the record stays, so a second down can finish the job
        raise RuntimeError(f"some of the cluster is still there after down; run `tether cluster down` again "
                           f"(record: {path})")
    path.unlink(missing_ok=True)
    removed = f", removed bridge {state.net['bridge']} and {len(state.net['nodes'])} namespaces" if state.net else ""
    print(f"tether: cluster down: stopped {len(pids)} processes of head {state.head_id[:12] or '(none)'}{removed}; "
          f"Ray's logs are kept in {state.temp_dir}")
    return EXIT_DONE


def cmd_kill_node(args, path: Path) -> int:
    state = _recorded(path)
    node_id, pids = local.kill(state, args.node)
    name = state.workers[node_id].get(local.NODE_LABEL)
    print(f"tether: killed node {name} ({node_id}): {len(pids)} processes SIGKILLed; "
          "Ray declares it dead within ~3 s")
    return EXIT_DONE


def cmd_cut_link(args, path: Path) -> int:
    name = local.set_link(_recorded(path), args.node, up=False)
    print(f"tether: cut the link of {name}: it is partitioned from the other nodes until "
          f"`tether cluster restore-link {name}`; Ray declares it dead if it stays cut for ~6 s")
    return EXIT_DONE


def cmd_restore_link(args, path: Path) -> int:
    name = local.set_link(_recorded(path), args.node, up=True)
    print(f"tether: restored the link of {name}")
    return EXIT_DONE


def _recorded(path: Path):
    state = local.load(path)
    if state is None:
        raise _Mistake(f"no cluster is recorded here ({path} does not exist); start one with `tether cluster up`")
    return state


COMMANDS = {"up": cmd_up, "status": cmd_status, "down": cmd_down, "kill-node": cmd_kill_node,
            "cut-link": cmd_cut_link, "restore-link": cmd_restore_link}

if __name__ == "__main__":
    sys.exit(main())

"""A PPO run built in this process on a cluster of several nodes, each pool pinned by a node
label to a node of its own, and a spare node joining once the pools are up (the only place a
lost node's actors can go): what the node-loss and partition tests share. ``nodes`` is either
tests/nodes.py's LocalNodes (nodes sharing one address) or tests/netns_nodes.py's NetnsNodes
(nodes with addresses of their own)."""
import threading
import time

import ray

from cluster.config.ppo import DEFAULT_CONFIG
from cluster.runtime.prepare import prepare

# node name -> (its label, logical CPUs); each pool asks for its node's label
NODES = {"gen": 1, "score": 2, "buffer": 1, "learn": 1}
POOL_NODE = {"generator": "gen", "reference": "score", "reward": "score", "buffer": "buffer", "learner": "learn"}


def label(node: str) -> dict:
    return {f"tether.{node}": "yes"}


class Cluster:
    """The run's nodes by name (node ids), the spare, and the driver on top. ``nodes``: node
    name -> logical CPUs; ``pools``: pool -> the node name it is pinned to; ``shared``: node
    name -> labels it carries beside its own (a pool several nodes may hold pins to one of them)."""

    def __init__(self, ray_nodes, tmp_path, *overrides, spare_for=tuple(NODES), nodes=NODES, pools=POOL_NODE,
                 shared=None):
        from cluster.config.ppo import load_config
        from cluster.runtime.loop.driver import Driver
        from cluster.runtime.observe.metrics import RunMetrics
        from cluster.runtime.pools.launch import create_pools

        self.nodes = ray_nodes
        labels = {name: {**label(name), **(shared or {}).get(name, {})} for name in nodes}
        self.ids = {name: ray_nodes.add(num_cpus=cpus, labels=labels[name]) for name, cpus in nodes.items()}
        pinned = [f"{pool}.node_labels=tether.{node}=yes" for pool, node in pools.items()]
        cfg = load_config(DEFAULT_CONFIG, ["model.dtype=float32", "run.eval_every=0", "run.samples_every=0",
                                           "run.plot_every=0",
                                           "resources.placement_timeout_s=60", *pinned, *overrides])
        policy, tokenizer_path, tokenizer, train_set, _ = prepare(cfg)
        self.pools = create_pools(cfg, policy_path=policy, tokenizer_path=tokenizer_path)
        self.metrics = RunMetrics(run_dir=tmp_path, plot_every=0)
        self.driver = Driver(cfg, pools=self.pools, dataset=train_set, eval_dataset=None, tokenizer=tokenizer,
                             metrics=self.metrics)
        # Joins after the pools are placed: nothing is on it until a node named in ``spare_for`` dies.
        spare = {k: v for name in spare_for for k, v in labels[name].items()}
        self.spare = ray_nodes.add(num_cpus=sum(nodes[n] for n in spare_for), labels=spare)
        self.killed_at = self._declared = None

    def kill(self, name: str) -> None:
        """SIGKILL the node whole, and watch for Ray declaring it dead (declared_at())."""
        node_id, declared = self.ids[name], []
        self.killed_at = time.perf_counter()
        self.nodes.kill(node_id)

        def watch():
            while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
                time.sleep(0.02)
            declared.append(time.perf_counter())

        self._declared = (threading.Thread(target=watch, daemon=True), declared)
        self._declared[0].start()

    def declared_at(self, timeout_s: float = 120.0) -> float:
        """When Ray declared the last killed node dead (perf_counter), as this process saw it."""
        thread, declared = self._declared
        thread.join(timeout_s)
        assert declared, f"Ray never declared the node dead within {timeout_s:.0f}s"
        return declared[0]

    def where(self, actor) -> str:
        from cluster.runtime.pools.placement import ask_nodes
        return ask_nodes({"actor": actor})["actor"]

    def close(self):
        self.metrics.close()
        self.pools.shutdown()


def on_call(obj, name: str, call: int, before) -> None:
    """Run ``before()`` ahead of the ``call``-th call of ``obj.name`` (then the call itself)."""
    original, calls = getattr(obj, name), []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            before()
        return original(*args, **kwargs)

    setattr(obj, name, wrapped)


# ---------------------------------------------------------------- a learner split over two nodes
# Every object goes to an object store (none inline in its owner's reply), as a real model's would.
STORED = {"max_direct_call_object_size": 1024}
# Roles packed as Ray packs a job without labels: a learner rank beside the reference (pair),
# the other rank on a node of its own; the learner may use either (tether.learn).
SPLIT_NODES = {"pair": 2, "rank": 1, "gen": 1, "rb": 2}
POOLS = {"reference": "pair", "generator": "gen", "reward": "rb", "buffer": "rb"}
LEARN = {"tether.learn": "yes"}
SPREAD_LEARNER = ("learner.replicas=2", "learner.strategy=spread", "learner.node_labels=tether.learn=yes")


SPLIT = {"nodes": SPLIT_NODES, "pools": POOLS, "shared": {"pair": LEARN, "rank": LEARN}, "spare_for": ("pair",)}


def split_run(nodes, tmp_path, *overrides) -> Cluster:
    """A run of SPLIT: the learner's two ranks on two nodes, every other pool elsewhere."""
    return Cluster(nodes, tmp_path, *SPREAD_LEARNER, *overrides, **SPLIT)


def transfer_rates(metrics: dict) -> tuple[float, float]:
    """(rollout-side bytes/s pulled from other nodes, weight-push bytes/s) of one step's row."""
    pulled = metrics["transfer/cross_node_bytes"] / max(metrics["transfer/cross_node_seconds"], 1e-9)
    return pulled, metrics["perf/sync_bytes"] / max(metrics["perf/sync_seconds"], 1e-9)


def print_rates(steps: list[dict]) -> None:
    for r in steps:
        pulled, pushed = transfer_rates(r)
        print(f"step {r['step']}: {r['transfer/cross_node_bytes'] / 1e6:.2f} MB pulled across nodes at "
              f"{pulled / 1e6:.1f} MB/s; weight push {r['perf/sync_bytes'] / 1e6:.2f} MB at {pushed / 1e6:.1f} MB/s; "
              f"step {r['perf/step_seconds']:.1f}s")


def pull_rates(source: str, dest: str, megabytes: int = 64, times: int = 3) -> list[float]:
    """Bytes/s of one ``megabytes`` MB object made on node ``source`` and pulled by a task on
    node ``dest`` (a new object each time): the object stores' own rate between two nodes."""
    import numpy as np
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def make(n):
        return np.ones(n, dtype=np.uint8)

    @ray.remote(num_cpus=0)
    def pull(refs):
        t0 = time.perf_counter()
        data = ray.get(refs[0])
        return data.nbytes / (time.perf_counter() - t0)

    rates = []
    for _ in range(times):
        ref = make.options(scheduling_strategy=NodeAffinitySchedulingStrategy(source, soft=False)).remote(
            megabytes << 20)
        ray.wait([ref], fetch_local=False)
        rates.append(ray.get(pull.options(scheduling_strategy=NodeAffinitySchedulingStrategy(dest, soft=False))
                             .remote([ref])))
        del ref
    return rates

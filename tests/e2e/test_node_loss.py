"""A whole Ray node dies mid-run; the run re-places what it carried and loses nothing.

Each pool is pinned by a node label to a node of its own (generators, the two scorers
together, the buffer, the learner), the way a user pins pools on a cluster. Once the pools
are up, a spare node carrying every label joins: the only place a dead node's actors can
go. A node is then SIGKILLed whole (its raylet and every process it started, found by its
node id) at a chosen phase of a step. The run must notice it, replace what the node held
on the spare, generate again what was lost, and account for every prompt exactly once; a
learner rank lost with its node rolls the run back to its last checkpoint.
"""
import threading
import time

import pytest
import ray
from accounting import Accounting
from jobs import finish, rows, start, status, wait_for_step
from node_runs import SPLIT, SPREAD_LEARNER, STORED, Cluster, label, on_call, print_rates, pull_rates

from cluster.runtime.loop.ledger import ChunkState

pytestmark = pytest.mark.e2e


@pytest.fixture
def run(ray_nodes, tmp_path):
    runs = []

    def make(*overrides, **kwargs):
        runs.append(Cluster(ray_nodes, tmp_path, *overrides, **kwargs))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def step_killing(cluster, node: str, when) -> dict:
    """One sync step during which ``node`` is killed as soon as ``when(ledger)`` holds."""
    ledger, fired, cluster.killed_at = cluster.driver.rollouts.ledger, threading.Event(), None

    def watch():
        while not fired.is_set():
            if when(ledger):
                cluster.kill(node)
                fired.set()
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        m = cluster.driver.step()
    finally:
        fired.set()
    assert cluster.killed_at is not None, f"node {node} was never killed"
    return m


def step_killing_after_rollouts(cluster, node: str) -> dict:
    """One sync step during which ``node`` is killed once all its rollouts are in the buffer."""
    produce, cluster.killed_at = cluster.driver.rollouts.produce, None

    def produce_then_kill(chunks, shaping):
        out = produce(chunks, shaping)
        if chunks and cluster.killed_at is None:  # the step's batch, not a regeneration after the loss
            cluster.kill(node)
        return out

    cluster.driver.rollouts.produce = produce_then_kill
    try:
        return cluster.driver.step()
    finally:
        cluster.driver.rollouts.produce = produce


def scoring(ledger) -> bool:
    return any(c.state is ChunkState.SCORING for c in ledger.in_flight())


# The slow tier. The default tier: test_losing_each_packed_node_in_turn_trains_every_prompt_once
# (below) loses nodes of several roles; scaling: tests/e2e/test_scale.py::
# test_pools_scale_up_and_down_while_the_job_runs.
@pytest.mark.slow
def test_losing_the_scorers_node_mid_step_then_scaling_onto_a_new_node(run):
    """The reference and the reward die together with their node while scoring; both are
    replaced on the spare node, the step's chunks are scored again, no prompt is lost. Then a
    node joins, and a second generator asked for through the scaling path starts on it."""
    c = run(spare_for=("score",))
    account = Accounting(c.driver)
    c.driver.step()
    m = step_killing(c, "score", scoring)
    after = c.driver.step()
    recoveries = {r["role"]: r for r in c.driver.rollouts.recoveries}
    assert set(recoveries) == {"reference", "reward"}
    for role in ("reference", "reward"):
        assert c.where(c.pools.by_role()[role].first()) == c.spare
    assert m["rollouts/redispatched_chunks"] >= 1 and m["rollouts/used"] == 64 == after["rollouts/used"]
    assert account.lost_and_twice() == (0, 0)
    assert [m["policy/version"], after["policy/version"]] == [2, 3]
    detected = min(r["detected"] for r in recoveries.values())
    detect, recover = detected - c.killed_at, max(r["serving"] for r in recoveries.values()) - detected
    print(f"\nscorers' node: detected in {detect:.2f}s, both replaced in {recover:.2f}s")
    assert_noticed_with_ray(c, detected)

    late = c.nodes.add(num_cpus=1, labels=label("gen"))  # the generators' node is full
    control = scale_to(c, generator=2)
    assert ray.get(control.health.remote())["sizes"]["generator"] == 2
    (new,) = set(c.pools.generators.handles()) - {"generator-0"}
    assert c.where(c.pools.generators.handles()[new]) == late
    m = c.driver.step()
    assert m["pool/generator_replicas"] == 2 and m["rollouts/used"] == 64
    assert m["ppo/logprob_gap_mean"] < 1e-3  # the new generator got the current weights first


def assert_noticed_with_ray(c, detected: float) -> None:
    """The run noticed the loss through Ray's declaring the node dead (or sooner), not through a
    timeout of its own: within one more of Ray's detection windows after the declaration, with
    room for a machine 3x slower. Timed from Ray's own event, so a machine's speed cancels out."""
    from cluster.nodes.health import NODE_FAILURE_DETECTION as d

    window = (d["health_check_period_ms"] * d["health_check_failure_threshold"] + d["health_check_timeout_ms"]) / 1e3
    late = detected - c.declared_at()
    print(f"noticed {late:+.2f}s after Ray declared the node dead (window {window:.0f}s)")
    assert late < 3 * window < c.driver.rollouts.health_timeout_s


def scale_to(c, **sizes):
    """What ``tether scale`` does, through the run's real control actor, applied at a step boundary."""
    from cluster.runtime.loop import scaling
    from cluster.runtime.pools.control import RunControl

    control = ray.remote(RunControl).options(num_cpus=0).remote(run_dir=str(c.metrics.run_dir),
                                                                sizes=c.pools.sizes())
    c.pools.extra_actors.append(control)
    ray.get(control.request.remote(sizes))
    scaling.apply_requested(control, c.pools, on_new_generator=c.driver._give_current_weights)
    return control


# The slow tier: the figures of docs/design/runtime.md's node-loss table (one run, four losses);
# the default tier: test_losing_each_packed_node_in_turn_trains_every_prompt_once.
@pytest.mark.slow
def test_node_loss_table(run):
    """Each pool's node is lost in turn, at the phase where it holds the most: (a) the
    generators' while generating, (b) the scorers' while scoring, (c) the buffer's with the
    step's rollouts stored in it, (d) the learner's while it trains. Prints the table."""
    c = run("run.checkpoint_every=1", "run.steps=6")
    account = Accounting(c.driver)
    c.driver.step()
    table = []

    def rollout_side(node, roles, when=None):
        """A step losing ``node`` when ``when(ledger)`` holds (None: once the step's rollouts are
        all stored, before the learner takes them)."""
        before = len(c.driver.rollouts.recoveries)
        m = step_killing(c, node, when) if when else step_killing_after_rollouts(c, node)
        new = [r for r in c.driver.rollouts.recoveries[before:] if r["role"] in roles]
        assert {r["role"] for r in new} == set(roles), new
        detect = min(r["detected"] for r in new) - c.killed_at
        recover = max(r["serving"] for r in new) - min(r["detected"] for r in new)
        lost, twice = account.lost_and_twice()
        table.append((node, ", ".join(roles), detect, recover, lost, twice))
        assert m["rollouts/used"] == 64 and (lost, twice) == (0, 0)

    rollout_side("gen", ("generator",), lambda ledger: any(c.state is ChunkState.GENERATING
                                                            for c in ledger.in_flight()))
    rollout_side("score", ("reference", "reward"), scoring)
    rollout_side("buffer", ("buffer",))
    for pool in ("generator", "reference", "reward"):
        assert c.where(c.pools.by_role()[pool].first()) == c.spare
    assert c.where(c.pools.buffer) == c.spare

    step = c.driver.step_count  # 4 (three steps with a loss each, after one without)
    c.driver.checkpoint()  # what run() writes after each step (run.checkpoint_every=1)
    train = c.pools.learner.train

    def train_then_lose_the_node(*args, **kwargs):
        threading.Timer(0.2, c.kill, args=("learn",)).start()  # while the update runs
        c.pools.learner.train = train
        return train(*args, **kwargs)

    c.pools.learner.train = train_then_lose_the_node
    c.driver.run()  # steps 5 and 6 (run.steps), the first one lost with the learner's node
    [rb] = c.driver.rollbacks
    assert (rb["failed_at_step"], rb["resumed_at_step"]) == (step, step)
    assert c.driver.step_count == step + 2 and c.where(c.pools.learner.workers[0]) == c.spare
    table.append(("learn", "learner rank 0", rb["detected_at"] - c.killed_at, rb["recovery_seconds"], 0, 0))
    print("\n| node carried | detect s | recover s | prompts lost | trained twice |\n|---|---|---|---|---|")
    for node, what, detect, recover, lost, twice in table:
        print(f"| {what} ({node}) | {detect:.2f} | {recover:.2f} | {lost} | {twice} |")


@pytest.mark.slow  # three full runs; the default suite loses worker nodes (below) and a driver (test_resume)
def test_head_node_death_ends_the_job_and_resubmitting_resumes(tmp_path):
    """The head (GCS and its raylet) dies mid-run: the job ends with it. A fresh cluster and the
    same command with run.resume=auto continue from the last checkpoint: every step once, the
    same trajectory as a run never interrupted."""
    from nodes import LocalNodes

    def cluster():  # this process stays out of it: a process connected to a lost head exits
        # The job's processes give up on a lost head after 2 s (not 10): it dies mid-run.
        nodes = LocalNodes(system_config={"gcs_rpc_server_reconnect_timeout_s": 2})
        for _ in range(2):
            nodes.add(num_cpus=2, labels={}, wait=True, connected=False)
        return nodes

    baseline_dir, run_dir, steps = tmp_path / "baseline", tmp_path / "run", "run.steps=10"
    first = cluster()
    try:
        assert finish(start(baseline_dir, f"resources.address={first.address}", steps)) == 0
        proc = start(run_dir, f"resources.address={first.address}", steps, "run.resume=auto")
        wait_for_step(run_dir, proc, 3)  # the checkpoint of step 2 is behind it
        first.kill_head()
        t0 = time.monotonic()
        rc = finish(proc, timeout=120)
        print(f"\nhead lost: the job ended (exit {rc}) {time.monotonic() - t0:.1f}s later")
        assert rc != 0 and status(run_dir)["state"] == "running"  # it could not write a result
    finally:
        first.shutdown(connected=False)
    second = cluster()
    try:
        assert finish(start(run_dir, f"resources.address={second.address}", steps, "run.resume=auto")) == 0
    finally:
        second.shutdown(connected=False)
    st, resumed, baseline = status(run_dir), rows(run_dir), rows(baseline_dir)
    assert st["state"] == "succeeded" and st["resumed_from_step"] in (2, 4, 6, 8)
    print(f"resumed from step {st['resumed_from_step']}")
    assert [r["step"] for r in resumed] == list(range(11))  # none missing, none twice
    for key in ("data/batches_issued", "reward/mean", "kl/mean", "kl/beta", "ppo/policy_loss", "ppo/grad_norm"):
        got, want = ([r.get(key) for r in rs if r["step"] > 0] for rs in (resumed, baseline))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), key


# ---------------------------------------------------------------- several roles on one lost node
# Roles packed on nodes the way Ray packs a job without labels (the learner beside the
# reference, the reward beside the buffer), each node then lost whole.
# Every object goes to an object store (none inline in its owner's reply, as a real model's
# rollouts and shards would not be), so a lost node takes its rollouts and shards with it.
PAIR = {"learner": "pair", "reference": "pair"}


@pytest.fixture
def stored_run(tmp_path):
    import rays
    from nodes import LocalNodes
    rays.leave()
    nodes, runs = LocalNodes(system_config=STORED), []
    ray.init(address=nodes.address, logging_level="WARNING")

    def make(*overrides, **kwargs):
        runs.append(Cluster(nodes, tmp_path, *overrides, **kwargs))
        return runs[-1]

    try:
        yield make
    finally:
        for r in runs:
            r.close()
        nodes.shutdown()


def test_losing_each_packed_node_in_turn_trains_every_prompt_once(stored_run, caplog):
    """Three nodes, each lost in turn in one run of three steps. Step 1: the generator's node
    is lost as its first chunk goes to be scored: the chunk's rollouts went with it, so it is
    generated again by a new generator on the spare. Step 2: the node of the reward and the
    buffer is lost just after the learner's take: the ranks' shards went with the buffer's
    object store (LearnerInputLost), so the run rolls back to step 1's checkpoint; the buffer
    and the reward start again on the spare. Step 3: the node of the learner's rank and the
    reference is lost as the learner trains: the run rolls back to step 2's checkpoint; the new
    rank (and the new reference) must not be started on the dying node before Ray declares it
    dead, or, if it is, started again; step 3 is made again on the new ones.

    The buffer's node is lost before the learner's: a rollback replaces the buffer, and with
    its node still alive the new one may land on the spare, where a later loss of that node
    would not take the shards."""
    nodes = {"pair": 2, "gen": 1, "rb": 1}
    # The spare carries every node's label and CPUs: all three nodes' actors end up on it.
    c = stored_run("run.steps=3", "run.checkpoint_every=1", nodes=nodes,
                   pools={**PAIR, "generator": "gen", "reward": "rb", "buffer": "rb"}, spare_for=tuple(nodes))
    account = Accounting(c.driver)
    account.follow_rollbacks(c.driver)
    on_call(c.driver.rollouts, "_score", 1, lambda: c.kill("gen"))
    # The learner's calls: step 1, step 2 (lost), step 2 again, step 3 (lost), step 3 again.
    on_call(c.pools.learner, "train", 2, lambda: c.kill("rb"))
    on_call(c.pools.learner, "train", 4, lambda: c.kill("pair"))
    c.driver.run()
    assert c.driver.step_count == 3
    assert "its rollouts were lost with a node" in caplog.text and "lost its input during train" in caplog.text
    assert [(rb["failed_at_step"], rb["resumed_at_step"]) for rb in c.driver.rollbacks] == [(1, 1), (2, 2)]
    roles = [r["role"] for r in c.driver.rollouts.recoveries]
    assert sorted(roles) == ["generator", "reference", "reward"], roles
    for actor in (c.pools.generators.first(), c.pools.rewards.first(), c.pools.buffer,
                  c.pools.references.first(), c.pools.learner.workers[0]):
        assert c.where(actor) == c.spare
    assert account.lost_and_twice() == (0, 0) and len(account.trained) == 3 * 64
    assert [r["step"] for r in rows(c.metrics.run_dir) if r["step"]] == [1, 2, 3]
    print(f"\nlearner's node: rollback {c.driver.rollbacks[-1]['recovery_seconds']:.1f}s after the loss was noticed")


@pytest.mark.slow
def test_transfer_rates_on_one_address(stored_run):
    """docs/performance.md's rates between nodes sharing this machine's address, for the run of
    tests/e2e/test_netns_run.py::test_transfer_rates_across_the_bridge (no fault)."""
    c = stored_run(*SPREAD_LEARNER, "run.steps=4", **SPLIT)
    c.driver.run()
    print_rates([r for r in rows(c.metrics.run_dir) if r["step"]])
    rates = pull_rates(c.ids["gen"], c.ids["rb"])
    print("64 MB object pulled between two nodes: " + ", ".join(f"{r / 1e6:.0f}" for r in rates) + " MB/s")

"""The import graph of the project: layers point downward, no module cycle exists, and no
module imports another's private (_underscore) names.

    core.infra        the plumbing every layer shares (errors, files, transfer accounting, HF loading rules)
    core              the shared vocabulary (rollout data units, PPO math, the estimator table)
    core.modeling     how a model is loaded and run: paths, tokenizer, packed rows, attention, vLLM engines
    actors.rewards    every reward source: the table, the scorers, their config sections, the built-ins
    actors.environments  the environment interface, the episode runner, its workers, the built-ins
    actors, learner   the rollout side, the training side (neither imports the other)
    cluster.config    the typed configs          cluster.demo   the built-in demo (tiny models, task)
    cluster.data      prompts, PTX text, stage rows
    cluster.job       the job lifecycle every entrypoint shares
    cluster.runtime   the PPO service, in rooms bottom to top: state (checkpoints, resume, lineage),
                      prepare (checks on user input), pools (actors and their placement), observe
                      (metrics, the step's row, console), loop (the driver, producers, recovery);
                      service.py on top
    cluster.recipes   SFT, reward model, pipeline, sweep
    cluster.*         the entrypoints (cluster.train, cluster.sft, ...): imported by cluster.cli alone
    bench             benchmarks

A module's layer is that of the longest prefix listed in LAYER. Imports inside functions
count too: a lazy import is still a dependency.
"""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"core.infra": 0, "core": 0.5, "core.modeling": 0.7,
         "actors.rewards": 0.8, "actors.environments": 0.9, "actors": 1, "learner": 1,
         "cluster.config": 2, "cluster.demo": 2,
         "cluster.data": 3,
         "cluster.nodes": 3,
         "cluster.job": 4,
         # cluster.runtime's rooms, bottom to top; cluster.runtime itself is the service on top of them
         "cluster.runtime.state": 5.0, "cluster.runtime.prepare": 5.1, "cluster.runtime.pools": 5.2,
         "cluster.runtime.observe": 5.3, "cluster.runtime.loop": 5.4, "cluster.runtime": 5.5,
         "cluster.recipes": 6, "cluster": 7, "bench": 8}
PACKAGES = ("core", "actors", "learner", "cluster", "bench")


def layer_of(module: str) -> str:
    """The LAYER key that owns ``module``: its longest listed prefix."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYER:
            return ".".join(parts[:n])
    raise KeyError(module)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (resolved to the deepest known module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    graph = {}
    for p in files:
        me = _module_name(p)
        graph[me] = {m for m in _imports(p, modules) if m != me and m != me.split(".")[0]}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        pkg = layer_of(mod)
        for dep in deps:
            dep_pkg = layer_of(dep)
            if dep_pkg != pkg and LAYER[dep_pkg] >= LAYER[pkg]:
                bad.append(f"{mod} -> {dep}")
    return sorted(bad)


def private_imports() -> list[str]:
    """``from X import _name`` where X is another project module: a private name used outside."""
    bad = []
    for p in (p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in PACKAGES:
                bad += [f"{_module_name(p)}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_checker_sees_a_planted_cycle_and_upward_import():
    g = {"core.a": {"learner.b"}, "learner.b": {"learner.c"}, "learner.c": {"learner.b"}}
    assert upward_imports(g) == ["core.a -> learner.b"]
    assert cycles(g) == [["learner.b", "learner.c"]]
    assert upward_imports({"actors.x": {"learner.y"}}) == ["actors.x -> learner.y"]  # sideways
    assert upward_imports({"cluster.runtime.x": {"cluster.recipes.y"}}) == ["cluster.runtime.x -> cluster.recipes.y"]
    assert upward_imports({"cluster.recipes.x": {"cluster.train"}}) == ["cluster.recipes.x -> cluster.train"]
    assert upward_imports({"cluster.demo.x": {"cluster.config.y"}}) == ["cluster.demo.x -> cluster.config.y"]


def test_no_upward_or_sideways_import():
    graph = import_graph()
    assert "core.ppo" in graph and "cluster.runtime.loop.driver" in graph  # the walk found the project
    assert upward_imports(graph) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_private_name_imported_across_modules():
    assert private_imports() == []


def test_every_cluster_module_has_a_layer():
    """A new subpackage of cluster/ must be placed in LAYER, not fall to the entrypoints' layer."""
    unplaced = [p.relative_to(ROOT).as_posix() for p in (ROOT / "cluster").iterdir()
                if p.is_dir() and (p / "__init__.py").exists() and f"cluster.{p.name}" not in LAYER]
    assert unplaced == []


def test_the_tether_command_imports_every_entrypoint_it_runs():
    """cluster.cli's table holds functions whose (lazy) imports this graph sees, not module names."""
    from cluster.cli import SUBCOMMANDS

    graph = import_graph()
    assert len(SUBCOMMANDS) == 7 and {"cluster.train", "cluster.sft", "cluster.reward_model", "cluster.pipeline",
                                      "cluster.sweep", "cluster.scale", "cluster.local_cluster"} <= graph["cluster.cli"]

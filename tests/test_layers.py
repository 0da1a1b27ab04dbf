"""The import graph of the project: layers point downward and no module cycle exists.

    core      the shared vocabulary (rollout data units, PPO math); imports nothing of ours
    actors    the rollout side        learner   the training side   (neither imports the other)
    cluster   pools, driver, entrypoints
    bench     benchmarks

Imports inside functions count too: a lazy import is still a dependency.
"""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"core": 0, "actors": 1, "learner": 1, "cluster": 2, "bench": 3}


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
    files = [p for pkg in LAYER for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    graph = {}
    for p in files:
        me = _module_name(p)
        graph[me] = {m for m in _imports(p, modules) if m != me and m != me.split(".")[0]}
    return graph


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in graph.items():
        pkg = mod.split(".")[0]
        for dep in deps:
            dep_pkg = dep.split(".")[0]
            if dep_pkg != pkg and LAYER[dep_pkg] >= LAYER[pkg]:
                bad.append(f"{mod} -> {dep}")
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


def test_no_upward_or_sideways_import():
    graph = import_graph()
    assert "core.ppo" in graph and "cluster.driver" in graph  # the walk found the project
    assert upward_imports(graph) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []

"""Short files and short functions in the product's code: a file over MAX_FILE_LINES lines or a
function over MAX_FUNCTION_LINES lines (decorators excluded, docstring included) fails here with
its place, so a module that grows past one concern is split when it happens, not in a clean-up.
"""
import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "actors", "learner", "cluster", "bench")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 50


def oversized(path: Path, *, max_file: int = MAX_FILE_LINES, max_function: int = MAX_FUNCTION_LINES) -> list[str]:
    """'where: N lines' for the file (if too long) and each too-long function in it."""
    text = path.read_text()
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    found = []
    n_lines = len(text.splitlines())
    if n_lines > max_file:
        found.append(f"{where}: {n_lines} lines")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > max_function:
                found.append(f"{where}:{node.lineno} {node.name}(): {length} lines")
    return found


def test_checker_sees_a_long_function_and_a_long_file(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    path = tmp_path / "long.py"
    path.write_text(f"def long():\n{body}\n\n\ndef short():\n    return 1\n")
    assert oversized(path) == [f"{path}:1 long(): 61 lines"]
    assert oversized(path, max_file=10, max_function=100) == [f"{path}: 65 lines"]


def test_files_and_functions_are_short():
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 50  # the walk found the project
    assert [problem for p in files for problem in oversized(p)] == []

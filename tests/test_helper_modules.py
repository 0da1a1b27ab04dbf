"""The tests' helper modules are imported by their bare names from the folders pyproject.toml's
pytest `pythonpath` puts on sys.path: a name in two of them, or one that is also a module of the
standard library or of an installed package, would import the wrong module."""
import importlib.machinery
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.unit


def test_helper_module_names_are_unique_and_shadow_nothing():
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    folders = [(REPO / p).resolve() for p in settings["pythonpath"]]
    where: dict[str, list[str]] = {}
    for folder in folders:
        for path in folder.glob("*.py"):
            if path.name != "conftest.py":  # pytest imports each conftest.py on its own
                where.setdefault(path.stem, []).append(str(path.relative_to(REPO)))
    assert where, folders
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"helper modules of the same name: {twice}"
    tests = (REPO / "tests").resolve()
    elsewhere = [p for p in sys.path if not Path(p or ".").resolve().is_relative_to(tests)]
    shadowed = {name: paths for name, paths in where.items()
                if name in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(name, elsewhere)}
    assert not shadowed, f"helper modules named like a module outside tests/: {shadowed}"

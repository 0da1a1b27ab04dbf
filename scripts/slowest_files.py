"""The test files that took longest in a pytest run, from its JUnit XML (scripts/test.sh writes one):
each file's seconds summed over its tests (set-up and teardown included, so a module's shared
start-ups count in its file), the slowest first, and the run's total.

    python scripts/slowest_files.py .test-results/junit.xml [N]
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def test_file(classname: str, root: Path) -> str:
    """tests.e2e.test_train(.TestClass) -> tests/e2e/test_train.py (the longest prefix that is a file)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = Path(*parts[:n]).with_suffix(".py")
        if (root / path).is_file():
            return str(path)
    return classname


def file_seconds(xml_path: Path, root: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        seconds[test_file(case.get("classname", ""), root)] += float(case.get("time") or 0)
    return dict(seconds)


def main(argv: list[str]) -> int:
    if not argv or not Path(argv[0]).is_file():
        print(f"slowest_files: no JUnit XML at {argv[0] if argv else '(none given)'}; nothing to report")
        return 0
    most = int(argv[1]) if len(argv) > 1 else 15
    seconds = file_seconds(Path(argv[0]), Path.cwd())
    print(f"slowest {min(most, len(seconds))} of {len(seconds)} test files ({sum(seconds.values()) / 60:.1f} min "
          "of tests in all):")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:most]:
        print(f"  {s:8.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

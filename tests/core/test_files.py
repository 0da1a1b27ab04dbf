"""Atomic writes: a file replaced whole, a directory published by rename."""
from __future__ import annotations

import stat

import pytest

from core.infra.errors import one_line, type_and_first_line
from core.infra.files import publish_dir, write_atomic

pytestmark = pytest.mark.unit


def test_write_atomic_replaces_the_file_readable_by_all_and_leaves_no_temp(tmp_path):
    path = tmp_path / "status.json"
    path.write_text("old")
    write_atomic(path, "new ü")
    write_atomic(tmp_path / "plot.png", b"\x89PNG")
    assert path.read_text(encoding="utf-8") == "new ü" and (tmp_path / "plot.png").read_bytes() == b"\x89PNG"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "status.json"]


def test_publish_dir_replaces_the_old_directory_only_once_complete(tmp_path):
    final = tmp_path / "step-000002"
    final.mkdir()
    (final / "old").write_text("x")
    with pytest.raises(RuntimeError):
        with publish_dir(final) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash mid-write")
    assert [p.name for p in final.iterdir()] == ["old"]  # the failed write published nothing
    with publish_dir(final) as tmp:
        (tmp / "new").write_text("x")
    assert [p.name for p in final.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]  # the crashed one's leftover is gone


def test_a_shared_publish_keeps_the_first_copy(tmp_path):
    final = tmp_path / "cache" / "model"
    with publish_dir(final, shared=True) as first, publish_dir(final, shared=True) as second:
        (first / "config.json").write_text("1")
        (second / "config.json").write_text("2")
    assert (final / "config.json").read_text() == "2"  # the inner block finished, so renamed, first
    assert [p.name for p in final.parent.iterdir()] == ["model"]


def test_one_line_is_the_last_error_line_and_type_and_first_line_the_first():
    remote = RuntimeError("ray::Learner.step()\n  File x\nValueError: bad batch\n")
    assert one_line(remote) == "ValueError: bad batch"
    assert one_line(RuntimeError("")) == "RuntimeError"
    assert type_and_first_line(ValueError("first\nsecond")) == "ValueError: first"
    assert type_and_first_line(KeyError()) == "KeyError"

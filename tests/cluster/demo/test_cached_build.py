"""A cached tiny model built once: a second builder of the same folder (the suite's background
prebuild and a test, or two runs) waits for the first and builds nothing."""
import threading

import pytest

from cluster.demo.tiny_models import cached_build

pytestmark = pytest.mark.unit


def test_a_build_under_way_is_waited_for_not_done_twice(tmp_path):
    path, started, release, built = tmp_path / "model", threading.Event(), threading.Event(), []

    def slow(out):
        built.append("first")
        started.set()
        assert release.wait(30)
        (out / "config.json").write_text("{}")

    first = threading.Thread(target=cached_build, args=(path, slow), daemon=True)
    first.start()
    assert started.wait(30)
    second_done = []
    second = threading.Thread(target=lambda: second_done.append(cached_build(path, lambda out: built.append("again"))),
                              daemon=True)
    second.start()
    second.join(0.5)  # it must still be waiting: the first build holds the folder's lock
    assert second.is_alive() and not second_done
    release.set()
    first.join(30)
    second.join(30)
    assert second_done == [path] and built == ["first"] and (path / "config.json").exists()


def test_a_killed_builders_half_folder_is_cleared_by_the_next_build(tmp_path):
    path = tmp_path / "model"
    (tmp_path / ".model-abc123").mkdir()  # what a builder killed mid-build leaves (publish_dir's temp folder)
    (tmp_path / ".model-abc123" / "half.bin").write_text("x")
    cached_build(path, lambda out: (out / "config.json").write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]

"""A worker whose import runs out of its memory cap says so, however the import failed: a
MemoryError, or a C extension's allocation failure that Python reports as something else
(sympy under a 64 MiB cap gave either, depending on the environment's thread settings)."""
import pytest

from core.infra.worker_process import import_failure

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", [
    "f 'm:g': MemoryError while importing it",
    "f 'm:g': cannot import module 'm' (SystemError: error return without exception set); fix the error in that module",
    "f 'm:g': cannot import module 'm' (ImportError: libx.so: failed to map segment from shared object)"])
def test_an_import_out_of_memory_names_the_cap(text):
    out = import_failure(text, 64, "reward.sandbox.memory_mb")
    assert out.startswith(text) and "reward.sandbox.memory_mb=64" in out and "raise it" in out


def test_other_import_failures_and_uncapped_workers_are_left_alone():
    typo = "f 'm:g': cannot import module 'm' (NameError: name 'x' is not defined); fix the error in that module"
    assert import_failure(typo, 64, "env.memory_mb") == typo
    uncapped = "f: MemoryError while importing it"
    assert import_failure(uncapped, 0, "env.memory_mb") == uncapped

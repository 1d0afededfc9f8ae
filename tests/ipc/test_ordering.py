"""ipc.ordering: the barriers' API, the CPU guard (by faking the architecture), and the
refusal to run without the extension."""
from __future__ import annotations

import mmap
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from ipc import ordering, shm
from ipc.ring import Ring

ROOT = Path(__file__).resolve().parents[2]


def test_words_load_and_store_u64_in_a_shared_mapping():
    mm = mmap.mmap(-1, 4096)
    q = memoryview(mm)[:64].cast("Q")
    w = ordering.Words(q)
    w.store_release(3, 2**64 - 1)
    assert q[3] == 2**64 - 1 and w.load_acquire(3) == 2**64 - 1
    q[7] = 12345
    assert w.load_acquire(7) == 12345
    ordering.fence()
    for bad in (-1, 8):
        with pytest.raises(IndexError):
            w.load_acquire(bad)
        with pytest.raises(IndexError):
            w.store_release(bad, 1)
    with pytest.raises(OverflowError):
        w.store_release(0, -1)
    with pytest.raises(OverflowError):
        w.store_release(0, 2**64)
    with pytest.raises(BufferError):
        q.release()  # the Words holds it, as a memoryview would
    w.release()
    w.release()  # idempotent
    with pytest.raises(ValueError, match="released"):
        w.load_acquire(0)
    with pytest.raises(ValueError, match="released"):
        w.store_release(0, 0)
    q.release()
    mm.close()


def test_words_refuses_what_it_cannot_access_whole():
    buf = bytearray(64)
    with pytest.raises(ValueError, match="8-byte boundary"):
        ordering.Words(memoryview(buf)[1:9])
    with pytest.raises(ValueError, match="whole u64"):
        ordering.Words(memoryview(buf)[:12])
    ro = ordering.Words(memoryview(bytearray(b"\x01" + bytes(63))).toreadonly())  # a status reader's
    assert ro.load_acquire(0) == 1
    with pytest.raises(TypeError, match="read-only"):
        ro.store_release(0, 2)
    ro.release()


@pytest.mark.parametrize("machine, arch", [("x86_64", "x86-64"), ("AMD64", "x86-64"),
                                           ("aarch64", "aarch64"), ("arm64", "aarch64")])
def test_cpus_the_barriers_are_written_for_pass(monkeypatch, machine, arch):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    assert ordering.check_cpu() == arch


@pytest.mark.parametrize("machine", ["ppc64le", "riscv64", "s390x", "armv7l", "i686", ""])
def test_other_cpus_are_refused_with_why(monkeypatch, shm_prefix, machine):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with pytest.raises(ordering.UnsupportedCPU) as err:
        ordering.check_cpu()
    msg = str(err.value)
    assert f"on a {machine or 'unknown'} CPU" in msg
    assert "x86-64" in msg and "aarch64" in msg and "python -m ipc.litmus" in msg
    # a ring is never made there, whoever forgot the start-up check
    with pytest.raises(ordering.UnsupportedCPU):
        Ring.create(shm_prefix, shm.new_run_id(), "refused", 4096)
    assert shm.list_objects(shm_prefix) == []


def test_atomics_that_are_not_lock_free_are_refused(monkeypatch):
    monkeypatch.setattr(ordering, "LOCK_FREE_U64", False)
    with pytest.raises(ordering.UnsupportedCPU, match="not lock-free"):
        ordering.check_cpu()


def test_without_the_extension_nothing_imports_and_the_error_says_how_to_build_it():
    code = (
        "import sys\n"
        "sys.modules['ipc._ordering'] = None  # as if it were not built\n"
        "for mod in ('ipc.ordering', 'ipc.ring', 'ipc.sleepers'):\n"
        "    try:\n"
        "        __import__(mod)\n"
        "    except ImportError as e:\n"
        "        print(mod, 'refused:', e)\n"
        "    else:\n"
        "        print(mod, 'imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 3 and all(" refused: " in line for line in lines), out
    assert "scripts/setup.sh" in out and "pip install -e ." in out

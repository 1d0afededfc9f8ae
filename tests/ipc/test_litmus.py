"""ipc.litmus, the rings' memory-ordering litmus test: its short form passes here, and it
does catch records and arena slots that are torn, stale or out of order."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ipc import litmus, shm

ROOT = Path(__file__).resolve().parents[2]


def test_the_short_form_passes_across_wrap_around(shm_prefix):
    out = litmus.run(2.0, prefix=shm_prefix)
    assert out["ok"] and out["failed"] is None, out
    assert out["records"] > 1000 and out["laps"] > 10, out  # it wrapped around, many times
    assert shm.list_objects(shm_prefix) == []


def test_the_command_says_passed_and_exits_0():
    p = subprocess.run([sys.executable, "-m", "ipc.litmus", "--seconds", "1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "torn 0, stale 0, out of order 0, arena torn 0, arena stale 0" in p.stdout
    assert p.stdout.rstrip().endswith("litmus: passed")


def test_each_kind_of_bad_record_is_named():
    slots = bytearray(litmus.SLOTS * litmus.SLOT)

    def fill(seq, what=None):
        at = seq % litmus.SLOTS * litmus.SLOT
        slots[at:at + litmus.SLOT] = litmus.slot_bytes(seq if what is None else what)

    s = litmus.SLOTS + 7  # a record of the second lap of the slots, with bytes after its number
    while len(litmus.record(s)) < 16:
        s += 1
    fill(s)
    assert litmus._check(litmus.record(s), s, slots) == (None, s)
    torn = bytearray(litmus.record(s))
    torn[12] ^= 1
    assert litmus._check(bytes(torn), s, slots) == ("torn", s)
    assert litmus._check(b"\x07", s, slots)[0] == "out_of_order"  # not even a number
    assert litmus._check(litmus.record(s - 2), s, slots) == ("stale", s - 2)  # a lap before
    assert litmus._check(litmus.record(s + 2), s, slots) == ("out_of_order", s + 2)  # two lost
    fill(s, s - litmus.SLOTS)  # the slot not yet written for it: the first lap's
    assert litmus._check(litmus.record(s), s, slots) == ("arena_stale", s)
    fill(s, s + litmus.SLOTS)  # the slot rewritten before it was read
    assert litmus._check(litmus.record(s), s, slots) == ("arena_torn", s)


def test_slots_reused_too_early_fail_the_run(shm_prefix, monkeypatch):
    """A planted ordering bug: too few arena slots, so the producer rewrites slots that
    records in the ring still point at; the run must fail, naming what it saw."""
    monkeypatch.setattr(litmus, "SLOTS", 4)  # the children are forked: they see it too
    out = litmus.run(1.0, prefix=shm_prefix)
    assert not out["ok"] and out["arena_torn"] + out["arena_stale"] > 0, out
    assert out["first"] and out["first"][0].startswith("arena"), out


def test_a_head_published_before_its_records_fails_the_run(shm_prefix, monkeypatch):
    """A planted ordering bug: the reordering a weakly ordered CPU may do without the
    release store, done on purpose (the producer stores head, then the records)."""
    from ipc import framing
    from ipc import ring as ring_mod

    late = []
    publish = ring_mod.Ring._publish

    def publish_then_write(self, new_head, n, wake_consumer=True):
        publish(self, new_head, n, wake_consumer)
        for args in late:
            framing.write_at(*args)
        late.clear()

    monkeypatch.setattr(ring_mod, "write_at",
                        lambda data, at, blob, n: late.append((data, at, bytes(blob), n)))
    monkeypatch.setattr(ring_mod.Ring, "_publish", publish_then_write)
    monkeypatch.setattr(litmus, "STALL_S", 1.0)  # the producer soon gives up on a consumer that stopped
    out = litmus.run(1.0, prefix=shm_prefix)
    assert not out["ok"] and out["torn"] + out["stale"] + out["out_of_order"] > 0, out

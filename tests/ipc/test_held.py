"""The held-alloc table: what a sender held is what its successor finds, whatever instant it died at."""
from __future__ import annotations

import os
import signal

from ipc import shm
from ipc.held import HeldAllocs
from ipc.wire import Alloc
from tests.helpers import fork_call, wait_child


def alloc(room: int, receiver: str = "rx") -> Alloc:
    return Alloc(receiver=receiver, room=room, item=0, dst=4096, dst_deepstack=8192, row_start=0, n_rows=4,
                 span=4, hidden=64, dtype="bfloat16", deepstack_width=32, fanout=1)


def test_what_is_held_is_found_again_and_removed_allocs_are_not(shm_prefix):
    run_id = shm.new_run_id()
    t = HeldAllocs.create(shm_prefix, run_id, "held", 4)
    try:
        slots = [t.put(10.0 + i, alloc(100 + i, "r" * 256)) for i in range(4)]
        assert None not in slots and t.put(99.0, alloc(999)) is None, "bounded"
        t.remove(slots[1])
        successor = HeldAllocs.attach(shm_prefix, run_id, "held")
        found = successor.load()
        assert sorted((since, a.room, a.receiver) for _, since, a in found) == \
            [(10.0, 100, "r" * 256), (12.0, 102, "r" * 256), (13.0, 103, "r" * 256)]
        assert found[0][2] == alloc(found[0][2].room, "r" * 256)
        assert successor.put(20.0, alloc(200)) is not None, "the removed slot is free again"
        assert successor.put(21.0, alloc(201)) is None
        successor.close()
    finally:
        t.close()
        t.unlink()


def test_the_key_an_alloc_came_under_is_held_with_it(shm_prefix):
    """(#32) Under CurveZMQ the room's keys are checked when it opens: a successor that
    finds the alloc held must find its key too, beside the longest receiver id."""
    run_id = shm.new_run_id()
    t = HeldAllocs.create(shm_prefix, run_id, "held", 2)
    try:
        keyed = alloc(300, "\U0001F600" * 256)
        keyed.key = "x" * 40
        keyed.incarnation = keyed.session_hash = 2**64 - 1
        assert t.put(30.0, keyed) is not None
        successor = HeldAllocs.attach(shm_prefix, run_id, "held")
        assert [a for _, _, a in successor.load()] == [keyed]
        successor.close()
    finally:
        t.close()
        t.unlink()


def _hold_forever(prefix: str, run_id: str) -> None:
    t = HeldAllocs.attach(prefix, run_id, "held")
    t.load()
    room = 0
    while True:
        room += 1
        slot = t.put(float(room), alloc(room))
        if slot is None or room % 3 == 0:
            for s, _, a in t.load():
                if a.room % 2:
                    t.remove(s)


def test_a_writer_killed_at_any_instant_leaves_whole_allocs(shm_prefix):
    run_id = shm.new_run_id()
    t = HeldAllocs.create(shm_prefix, run_id, "held", 64)
    try:
        for k in range(30):
            pid = fork_call(_hold_forever, shm_prefix, run_id)
            os.sched_yield()
            for _ in range(k * 200):
                pass
            os.kill(pid, signal.SIGKILL)
            assert wait_child(pid) == -signal.SIGKILL
            successor = HeldAllocs.attach(shm_prefix, run_id, "held")
            for _, since, a in successor.load():
                assert a == alloc(a.room) and since == float(a.room), (since, a)
            successor.close()
    finally:
        t.close()
        t.unlink()

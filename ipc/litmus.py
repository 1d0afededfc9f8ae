"""Litmus test of the rings' memory ordering on this host: ``python -m ipc.litmus [--seconds S]``.

A producer process and a consumer process hammer one small ring for ``S`` seconds
(about a minute by default).  Every byte of record ``seq`` derives from ``seq``, and
before pushing it the producer fills an arena slot (``seq`` modulo the slots) the
record points at, as a stage fills rows before it hands on their lease; the ring's
capacity makes records wrap around its end every lap, and the slots are reused as
soon as the ring lets them be.  The consumer checks every record and its slot before
it gives the record back (a batch at once and one at a time, in turn), and counts:

- torn: a record, or its arena slot, whose bytes do not all belong to it (a slot
  already rewritten for a later record counts here);
- stale: a record or a slot that still holds what an earlier ``seq`` wrote there,
  a lap before (its bytes were read before they arrived);
- out of order: a record whose ``seq`` is ahead of the next one expected (one lost),
  or an end of run that says more were pushed than arrived.

A ring the consumer finds corrupt counts as torn.  It exits 0 when there were none,
1 on any, 2 when the run itself failed (a process that died or stalled).  On x86-64
(TSO) a pass shows the ring's logic is right; on a weakly ordered CPU (aarch64) it
also shows the barriers are where they must be.  An emulator (qemu-user) does not
reorder memory as hardware does: a pass there shows only that it builds and runs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

from ipc import shm
from ipc.ordering import check_cpu
from ipc.ring import Ring, RingError

__all__ = ["KINDS", "main", "run"]

PREFIX = "litmus"
# Odd, so that records straddle the end of the ring at ever different offsets.
CAPACITY = 16 * 1024 + 3
MAX_PAYLOAD = 307  # payloads are 8..MAX_PAYLOAD bytes
MAX_BATCH = 32
SLOT = 256  # bytes of one arena slot
# Records the ring can hold at once (the smallest is its 5-byte header and 8 bytes),
# plus the batch being written: a slot is never rewritten while a record points at it.
SLOTS = CAPACITY // (5 + 8) + MAX_BATCH + 1
STALL_S = 10.0  # a side that waits this long for the other has lost it
END = b"\xff" * 8
KINDS = ("torn", "stale", "out_of_order", "arena_torn", "arena_stale")
_PATTERN = bytes(range(256)) * 3


def record(seq: int) -> bytes:
    """Record ``seq``: its number, then ``(seq + i) % 256`` for its i-th following byte."""
    n = 8 + (seq * 40503) % (MAX_PAYLOAD - 7)
    k = seq % 256
    return seq.to_bytes(8, "little") + _PATTERN[k : k + n - 8]


def slot_bytes(seq: int) -> bytes:
    """What record ``seq``'s arena slot holds."""
    k = seq * 7 % 256
    return seq.to_bytes(8, "little") + _PATTERN[k : k + SLOT - 8]


def _produce(prefix: str, run_id: str, seconds: float, conn) -> None:
    ring = Ring.attach(prefix, run_id, "ring")
    arena = shm.Segment.attach(shm.object_name(prefix, run_id, "arena"))
    slots = arena.buf
    deadline = time.monotonic() + seconds
    seq = 0
    try:
        while time.monotonic() < deadline:
            batch = []
            for s in range(seq, seq + 1 + seq % MAX_BATCH):
                at = s % SLOTS * SLOT
                slots[at : at + SLOT] = slot_bytes(s)
                batch.append(record(s))
            # The push's release store of head publishes the slots written above too.
            if ring.push_batch(batch, timeout=STALL_S) < len(batch):
                conn.send(("failed", f"producer: no room for {STALL_S:.0f} s at record {seq}"))
                return
            seq += len(batch)
        if not ring.push(END + seq.to_bytes(8, "little"), timeout=STALL_S):
            conn.send(("failed", "producer: no room for the end of the run"))
            return
        conn.send(("pushed", seq))
    finally:
        ring.close()
        arena.close()


def _check(rec: bytes, expected: int, slots) -> tuple[str | None, int]:
    """(what is wrong with ``rec``, taken as record ``expected``, or None; its seq)."""
    got = int.from_bytes(rec[:8], "little") if len(rec) >= 8 else -1
    if got != expected:
        return ("stale" if 0 <= got < expected else "out_of_order"), got
    if rec != record(got):
        return "torn", got
    at = got % SLOTS * SLOT
    held = slots[at : at + SLOT]
    if held != slot_bytes(got):
        return ("arena_stale" if int.from_bytes(held[:8], "little") < got else "arena_torn"), got
    return None, got


def _consume(prefix: str, run_id: str, conn) -> None:
    ring = Ring.attach(prefix, run_id, "ring")
    arena = shm.Segment.attach(shm.object_name(prefix, run_id, "arena"))
    counts = dict.fromkeys(KINDS, 0)
    first: list[str] = []
    checked = _check_all(ring, arena.buf, counts, first)
    if checked is None:
        conn.send(("failed", f"consumer: nothing came for {STALL_S:.0f} s"))
    else:
        conn.send(("checked", checked, counts, first[:5], ring.head // ring.capacity))
    ring.close()
    arena.close()


def _check_all(ring: Ring, slots, counts: dict, first: list) -> int | None:
    """Check records until the end of the run; how many, or None if the producer stalled."""
    expected = 0
    one_at_a_time = False
    try:
        while True:
            recs, end = ring.peek_batch(256, timeout=STALL_S)
            if not recs:
                return None
            for rec in recs:
                if rec[:8] == END:
                    pushed = int.from_bytes(rec[8:16], "little")
                    if pushed != expected:
                        counts["out_of_order"] += 1
                        first.append(f"out of order: {pushed} records pushed, {expected} arrived")
                    ring.release(end)
                    return expected
                kind, got = _check(rec, expected, slots)
                if kind is not None:
                    counts[kind] += 1
                    first.append(f"{kind.replace('_', ' ')}: record {expected} read as {got} ({len(rec)} bytes)")
                expected = max(expected, got) + 1
            if one_at_a_time:  # the reaper's and the tower's way, then everyone else's
                for _ in recs:
                    ring.release_one()
            else:
                ring.release(end)
            one_at_a_time = not one_at_a_time
    except RingError as e:  # a header or a length read before it arrived: the ring is lost
        counts["torn"] += 1
        first.append(f"torn: {e}")
        return expected


def _child(fn, who: str, conn, *args) -> None:
    try:
        fn(*args, conn)
    except BaseException as e:  # report it rather than leave the parent waiting
        conn.send(("failed", f"{who}: {e!r}"))
        raise


def _report(conn, proc, who: str, wait: float):
    deadline = time.monotonic() + wait
    while not conn.poll(0.5):
        if not proc.is_alive() and not conn.poll(0):
            return ("failed", f"{who} died (exit code {proc.exitcode})")
        if time.monotonic() > deadline:
            return ("failed", f"{who}: no report in {wait:.0f} s")
    return conn.recv()


def run(seconds: float, prefix: str = PREFIX) -> dict:
    """Run the litmus for ``seconds``; a dict of what it counted (``ok``: none of
    ``KINDS``; ``failed``: why the run itself failed, or None)."""
    arch = check_cpu()
    shm.sweep(prefix)  # what dead runs left; live ones are left alone
    lock = shm.RunLock(prefix)
    ctx = mp.get_context("fork")
    procs = []
    try:
        ring = Ring.create(prefix, lock.run_id, "ring", CAPACITY)
        ring.close()
        shm.Segment.create(shm.object_name(prefix, lock.run_id, "arena"), SLOTS * SLOT).close()
        (c_in, c_out), (p_in, p_out) = ctx.Pipe(False), ctx.Pipe(False)
        procs = [
            ctx.Process(target=_child, args=(_consume, "consumer", c_out, prefix, lock.run_id)),
            ctx.Process(target=_child, args=(_produce, "producer", p_out, prefix, lock.run_id, seconds)),
        ]
        for p in procs:
            p.start()
        wait = seconds + 2 * STALL_S + 30
        out: dict[str, Any] = {
            "architecture": arch,
            "seconds": seconds,
            "failed": None,
            "records": 0,
            "laps": 0,
            "first": [],
            **dict.fromkeys(KINDS, 0),
        }
        for who, conn, proc in (("producer", p_in, procs[1]), ("consumer", c_in, procs[0])):
            msg = _report(conn, proc, who, wait)
            if msg[0] == "failed":
                out["failed"] = out["failed"] or msg[1]
            elif msg[0] == "checked":
                out["records"], counts, out["first"], out["laps"] = msg[1:]
                out.update(counts)
        out["violations"] = sum(out[k] for k in KINDS)
        out["ok"] = out["failed"] is None and not out["violations"]
        return out
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        shm.sweep(prefix, lock.run_id, include_live=True)
        lock.release()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=50.0, help="how long to hammer the ring (default 50)")
    args = ap.parse_args(argv)
    out = run(args.seconds)
    print(
        f"litmus on {out['architecture']}: {out['records']:,} records and arena slots checked in "
        f"{out['seconds']:g} s, {out['laps']:,} laps of a {CAPACITY:,}-byte ring"
    )
    print("  " + ", ".join(f"{k.replace('_', ' ')} {out[k]}" for k in KINDS))
    for line in out["first"]:
        print(f"  {line}")
    if out["violations"]:
        print("litmus: FAILED: records or arena slots were read torn, stale or out of order")
        return 1
    if out["failed"]:
        print(f"litmus: the run failed: {out['failed']}")
        return 2
    print("litmus: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

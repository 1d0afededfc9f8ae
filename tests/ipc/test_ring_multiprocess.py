"""ipc.ring across processes, with SIGKILLs: 1,000,000 records, exactly once, in order, whole.

A producer process streams records (sequence number, crc32, variable-size body) in
batches; a consumer process checks every one.  One test SIGKILLs the producer at
random moments and starts a successor, the other does the same to the consumer.

Exactly once across kills, with nothing but the ring and a small control segment:

- the producer writes a write-ahead *intent* (first seq of the batch, its length,
  ``head`` before it) before each ``push_batch``; a successor compares the intent
  with ``ring.head`` and, since record sizes follow from sequence numbers, knows how
  many records of that batch were published (and checks that the published bytes
  end exactly on a record boundary: no partial record was ever published);
- the consumer ``peek_batch``es, checks, appends to its *log* (count, last seq, end
  index) and only then ``release``s; a successor whose log is ahead of ``ring.tail``
  (its predecessor died between the two) releases up to the logged end first.

Both records are double-buffered and switched by one 8-byte store, so a kill while
writing one leaves the previous one intact.

Besides the kills at random moments, every other successor is started with a plan
to SIGKILL itself at a (seeded) point in the narrow windows random kills rarely hit:
a producer just before or just after one of its ``head`` stores, a consumer between
writing its log and releasing.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import struct
import time
import zlib

import pytest

from ipc import shm
from ipc.ring import RECORD_HEADER, Ring

N = 1_000_000
BATCH = 512
CAPACITY = 262_139  # not a power of two: records wrap at every offset
KILLS = 6
CTX = mp.get_context("fork")
REC = struct.Struct("<QI")  # seq, crc32(body, seq)
FILL = random.Random(1234).randbytes(1 << 16)
NONE = (1 << 64) - 1

# control segment words
P_GEN, P_SLOTS = 0, (1, 4)  # intent: first seq, n, head before
C_GEN, C_SLOTS = 8, (9, 12)  # log: count, last seq, end index
ERR, ERR_A, ERR_B = 16, 17, 18
P_STARTS, P_PARTIAL, C_STARTS, C_RECONCILED = 20, 21, 22, 23

E_ORDER, E_SIZE, E_CRC, E_LOG_BEHIND, E_PARTIAL_RECORD, E_HEAD = range(1, 7)


def body_size(seq: int) -> int:
    n = (seq * 2654435761 >> 16) % 97
    return n + 3000 if seq % 1009 == 0 else n  # now and then one that spans pages


def record_footprint(seq: int) -> int:
    return RECORD_HEADER + REC.size + body_size(seq)


def make_record(seq: int) -> bytes:
    n = body_size(seq)
    off = (seq * 7919) % (len(FILL) - 4096)
    body = FILL[off:off + n]
    return REC.pack(seq, zlib.crc32(body, seq & 0xFFFFFFFF)) + body


def _write2(q, gen_at: int, slots, values) -> None:
    gen = q[gen_at]
    base = slots[(gen + 1) % 2]
    for i, v in enumerate(values):
        q[base + i] = v
    q[gen_at] = gen + 1  # one 8-byte store switches to the new slot


def _read2(q, gen_at: int, slots):
    gen = q[gen_at]
    if gen == 0:
        return None
    base = slots[gen % 2]
    return q[base], q[base + 1], q[base + 2]


def _fail(q, code: int, a: int = 0, b: int = 0) -> None:
    q[ERR_A], q[ERR_B] = a, b
    q[ERR] = code
    os._exit(10 + code)


def _attach(prefix, run_id):
    ring = Ring.attach(prefix, run_id, "ring")
    ctl = shm.Segment.attach(shm.object_name(prefix, run_id, "ctl"))
    return ring, ctl, ctl.buf.cast("Q")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _plan_publish_death(k: int, where: str) -> None:
    """SIGKILL this process at its k-th head store, just before or just after it."""
    publish = Ring._publish
    calls = [0]

    def dying_publish(self, new_head, n, wake_consumer=True):
        calls[0] += 1
        if calls[0] == k and where == "before":
            _die()  # payload written, head not stored
        publish(self, new_head, n, wake_consumer)
        if calls[0] == k:
            _die()  # head stored, the producer's own bookkeeping not

    Ring._publish = dying_publish


def producer_main(prefix: str, run_id: str, plan=None) -> None:
    if plan is not None:
        _plan_publish_death(*plan)
    ring, ctl, q = _attach(prefix, run_id)
    q[P_STARTS] += 1
    intent = _read2(q, P_GEN, P_SLOTS)
    head = ring.head
    if intent is None:
        if head != 0:
            _fail(q, E_HEAD, head)
        seq = 0
    else:
        first, n, head_before = intent
        published = head - head_before
        k = done = 0
        while done < published and k < n:
            done += record_footprint(first + k)
            k += 1
        if done != published:
            _fail(q, E_PARTIAL_RECORD, first, published)
        if 0 < k < n:
            q[P_PARTIAL] += 1  # the predecessor died with part of a batch published
        seq = first + k
    while seq < N:
        n = min(BATCH, N - seq)
        batch = [make_record(s) for s in range(seq, seq + n)]
        _write2(q, P_GEN, P_SLOTS, (seq, n, ring.head))
        assert ring.push_batch(batch, timeout=None) == n
        seq += n
    ring.close()


def consumer_main(prefix: str, run_id: str, plan=None) -> None:
    ring, ctl, q = _attach(prefix, run_id)
    q[C_STARTS] += 1
    log = _read2(q, C_GEN, C_SLOTS)
    count, last, end = log if log is not None else (0, NONE, 0)
    tail = ring.tail
    if end > tail:  # logged but not released when the predecessor died
        ring.release(end)
        q[C_RECONCILED] += 1
    elif end < tail:
        _fail(q, E_LOG_BEHIND, end, tail)
    expect = 0 if last == NONE else last + 1
    unpack, crc32 = REC.unpack_from, zlib.crc32
    while count < N:
        recs, end = ring.peek_batch(1024, timeout=1.0)
        if not recs:
            continue
        for r in recs:
            seq, crc = unpack(r)
            if seq != expect:
                _fail(q, E_ORDER, seq, expect)
            if len(r) != REC.size + body_size(seq):
                _fail(q, E_SIZE, seq, len(r))
            if crc32(memoryview(r)[REC.size:], seq & 0xFFFFFFFF) != crc:
                _fail(q, E_CRC, seq)
            expect += 1
        count += len(recs)
        _write2(q, C_GEN, C_SLOTS, (count, expect - 1, end))
        if plan is not None:
            plan -= 1
            if plan == 0:
                _die()  # logged, not released
        ring.release(end)
    ring.close()


def _start(fn, prefix, run_id, plan=None):
    p = CTX.Process(target=fn, args=(prefix, run_id, plan), daemon=True)
    p.start()
    return p


def _run(shm_prefix: str, victim: str) -> None:
    seed = int(os.environ.get("RING_KILL_SEED", random.randrange(1 << 32)))
    print(f"\n{victim} kill test: seed {seed} (rerun with RING_KILL_SEED={seed})")
    rng = random.Random(seed)
    run_id = shm.new_run_id()
    ring = Ring.create(shm_prefix, run_id, "ring", CAPACITY)
    ctl = shm.Segment.create(shm.object_name(shm_prefix, run_id, "ctl"), 4096)
    q = ctl.buf.cast("Q")
    procs = {}

    def check_alive_or_ok():
        for name, p in procs.items():
            assert p.exitcode in (None, 0, -signal.SIGKILL), (
                f"{name} exit {p.exitcode}, error {q[ERR]} ({q[ERR_A]}, {q[ERR_B]}), "
                f"seed {seed}, {ring.stats()}"
            )

    def consumed():
        log = _read2(q, C_GEN, C_SLOTS)
        return 0 if log is None else log[0]

    def wait(p, timeout):
        end = time.monotonic() + timeout
        while p.exitcode is None and time.monotonic() < end:
            check_alive_or_ok()
            time.sleep(0.01)
        p.join(0.1)

    try:
        procs["consumer"] = _start(consumer_main, shm_prefix, run_id)
        procs["producer"] = _start(producer_main, shm_prefix, run_id)
        fn = producer_main if victim == "producer" else consumer_main
        kills = planned = 0
        # Random moments spread over the run whatever the machine's speed: when the
        # consumer's count passes a random mark, plus a random few milliseconds.
        marks = sorted(rng.sample(range(N // 50, N * 9 // 10), KILLS))
        for i, mark in enumerate(marks):
            end = time.monotonic() + 60
            while consumed() < mark and procs[victim].exitcode is None:
                check_alive_or_ok()
                assert time.monotonic() < end, f"no progress (seed {seed}): {ring.stats()}"
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.005))
            check_alive_or_ok()
            p = procs[victim]
            if not p.is_alive():
                break
            os.kill(p.pid, signal.SIGKILL)
            p.join()
            if p.exitcode != -signal.SIGKILL:  # it finished (or failed) first
                break
            kills += 1
            if i % 2 == 0:  # a successor that kills itself in a narrow window
                if victim == "producer":
                    plan = (rng.randint(1, 60), rng.choice(["before", "after"]))
                else:
                    plan = rng.randint(1, 40)
                p = procs[victim] = _start(fn, shm_prefix, run_id, plan)
                wait(p, 60)
                if p.exitcode != -signal.SIGKILL:
                    break
                planned += 1
                print(f"planned {victim} death {plan}")
            procs[victim] = _start(fn, shm_prefix, run_id)
        for name, p in procs.items():
            wait(p, 90)
            assert p.exitcode == 0, (
                f"{name} exit {p.exitcode}, error {q[ERR]} ({q[ERR_A]}, {q[ERR_B]}), "
                f"seed {seed}, {ring.stats()}"
            )
        print(
            f"{kills} random + {planned} planned {victim} kills; producer starts {q[P_STARTS]}, partly published "
            f"batches {q[P_PARTIAL]}; consumer starts {q[C_STARTS]}, logged-not-released "
            f"{q[C_RECONCILED]}; {ring.stats()}"
        )
        assert q[ERR] == 0
        assert kills >= 2 and planned >= 1, (
            f"the {victim} finished before it could be killed enough (seed {seed})"
        )
        count, last, end = _read2(q, C_GEN, C_SLOTS)
        assert (count, last) == (N, N - 1)
        assert ring.head == ring.tail == end
        stats = ring.stats()
        assert stats["pushed"] == stats["popped"] == N and ring.depth() == 0
    finally:
        for p in procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        q.release()
        ctl.close()
        ctl.unlink()
        ring.close()
        ring.unlink()


@pytest.mark.timeout(300)
def test_producer_sigkilled_and_restarted(shm_prefix):
    _run(shm_prefix, "producer")


@pytest.mark.timeout(300)
def test_consumer_sigkilled_and_restarted(shm_prefix):
    _run(shm_prefix, "consumer")

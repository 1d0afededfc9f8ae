"""A receiver process of the chaos run: one prefill rank under test. It allocs what the
harness tells it, fills its buffer with canary bytes, and checks every status it hears:
rows bit-exact against the sim tower's formula on success (and against the success's
digest), nothing written after a failed, no (room, item) concluded twice. A room it
heard nothing of for QUERY_AFTER_S is queried (protocol 1.1); a repeat of a status it
has is dropped, one it lacked counts as recovered."""
from __future__ import annotations

import heapq
import logging
import os
import signal
import time
from collections import deque

import numpy as np

from pipeline.testing.chaos.settings import CANARY, DEEPSTACK, DTYPE, HIDDEN, QUARANTINE_S, QUERY_AFTER_S, span_of
from pipeline.testing.sim import expected_sim_rows, pixels, sim_pattern


class ExpectedRows:
    """The sim tower's rows of the run's images (pixels(seed, grid)), remembered a while."""

    def __init__(self):
        sim_pattern(DTYPE)  # built now, before the receiver reports ready, not at its first success
        self.memo: dict = {}

    def __call__(self, seed: int, grid, modality: str):
        key = (seed, tuple(grid), modality)
        if key not in self.memo:
            if len(self.memo) > 256:
                self.memo.clear()
            self.memo[key] = expected_sim_rows(pixels(seed, grid), modality, span_of(grid), HIDDEN, DEEPSTACK,
                                               DTYPE)
        return self.memo[key]


class RxRoom:
    def __init__(self):
        self.shards: dict[int, dict] = {}   # item -> its shard spec
        self.success: set[int] = set()
        self.failed: str | None = None
        self.released = False
        self.snaps: dict[int, np.ndarray] = {}


class ChaosReceiver:
    """One prefill rank under test: allocs what the harness says, checks every status."""

    def __init__(self, rx_id: str, bootstrap: str, conn, buffer_bytes: int):
        from pipeline.peers.receiver import Receiver

        self.conn = conn
        self.r = Receiver(rx_id, bootstrap, buffer_bytes=buffer_bytes, query_after_s=None)  # queried here
        self.r.buffer.fill(CANARY)
        self.expected = ExpectedRows()
        self.rooms: dict[int, RxRoom] = {}
        self.early: dict[int, list] = {}    # statuses for rooms not allocated (yet) here
        self.cancels: list = []             # heap of (when, room)
        self.quarantine: deque = deque()    # (check at, room)
        self.heard_at: dict[int, float] = {}  # rooms not concluded here: when last heard of (or allocated)
        self.query_at = 0.0

    def violation(self, text: str, kind: str = "other") -> None:
        self.conn.send(("violation", f"receiver {self.r.id}: {text}", kind))

    def run(self) -> None:
        while True:
            while self.conn.poll(0):
                msg = self.conn.recv()
                if msg[0] == "finish":
                    self.finish()
                    return
                self.on_room(*msg[1:])
            for st in self.statuses(0.005):
                self.on_status(st)
            now = time.monotonic()
            while self.cancels and self.cancels[0][0] <= now:
                _, room = heapq.heappop(self.cancels)
                self.r.cancel(room)
            while self.quarantine and self.quarantine[0][0] <= now:
                self.check_canaries(self.quarantine.popleft()[1])
            if now >= self.query_at:
                self.query_at = now + QUERY_AFTER_S / 4
                self.query_silent(now)
            for room in [k for k, v in self.early.items() if v[0][0] < now - 120]:
                del self.early[room]

    def statuses(self, timeout: float) -> list[dict]:
        """Status frames read here, not through Receiver.poll: this is the checker, so it sees
        every frame, not only those the library applies."""
        import zmq

        from ipc import wire

        out = []
        sock = self.r.status_sock
        if sock.poll(int(timeout * 1000)):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    out.append(wire.decode(frame))
                except wire.ProtocolError as e:
                    self.violation(f"unparseable status: {e}")
        return out

    def query_silent(self, now: float) -> None:
        for room, at in list(self.heard_at.items()):
            rec = self.rooms[room]
            if rec.failed is not None or rec.success == set(rec.shards):
                del self.heard_at[room]
            elif now - at >= QUERY_AFTER_S:
                self.heard_at[room] = now
                self.r.query(room)

    def on_room(self, room: int, shards: list[dict], cancel_after: float | None) -> None:
        rec = self.rooms[room] = RxRoom()
        self.heard_at[room] = time.monotonic()
        for s in shards:
            self.r.alloc(room, s["item"], span=s["span"], hidden=HIDDEN, dtype=DTYPE,
                         deepstack_width=DEEPSTACK, fanout=s["fanout"], row_start=s["row_start"],
                         n_rows=s["n_rows"])
            rec.shards[s["item"]] = s
        if cancel_after is not None:
            heapq.heappush(self.cancels, (time.monotonic() + cancel_after, room))
        for _, st in self.early.pop(room, []):  # a status that came before our allocs went out
            self.on_status(st)

    def on_status(self, st: dict) -> None:
        room, item, state, reason = st.get("room"), st.get("item"), st.get("state"), st.get("reason", "")
        rec = self.rooms.get(room)
        if rec is None:
            # Not allocated here (yet): a room failed before we allocated, or a broadcast
            # after a sender death to every registered receiver, which ignores the rest.
            self.early.setdefault(room, []).append((time.monotonic(), st))
            return
        if room in self.heard_at:
            self.heard_at[room] = time.monotonic()
        if st.get("repeat"):
            if rec.failed is not None or state == "success" and item in rec.success:
                return  # the answer to a query, of a status that did come
            self.conn.send(("recovered", room, item))
        if state == "success":
            if rec.failed is not None:
                self.violation(f"success for room {room} item {item} after failed ({rec.failed})", "duplicate")
            elif item not in rec.shards:
                self.violation(f"success for room {room} item {item}, which it never allocated")
            elif item in rec.success:
                self.violation(f"second success for room {room} item {item}", "duplicate")
            else:
                rec.success.add(item)
                self.check_rows(room, item, rec.shards[item])
                if st.get("digest") is not None and not self.r.digest_agrees(room, item, st["digest"]):
                    self.violation(f"room {room} item {item}: its rows do not hash to the success's digest",
                                   "digest_mismatch")
            self.conn.send(("status", room, item, "success", "", time.monotonic()))
            if rec.failed is None and rec.success == set(rec.shards) and not rec.released:
                self.release(room, rec)
        elif state == "failed":
            if rec.failed is not None:
                self.violation(f"second failed for room {room} ({rec.failed!r}, then {reason!r})", "duplicate")
                return
            rec.failed = reason
            if not rec.released:
                for i in rec.shards:
                    s = self.r.shards[(room, i)]
                    rec.snaps[i] = self.r.buffer[s.offset:s.offset + s.nbytes].copy()
                self.quarantine.append((time.monotonic() + QUARANTINE_S, room))
            self.conn.send(("status", room, None, "failed", reason, time.monotonic()))
        else:
            self.violation(f"status with state {state!r} for room {room}")

    def check_rows(self, room: int, item: int, s: dict) -> None:
        main, deep = self.expected(s["seed"], s["grid"], s["modality"])
        a, b = s["row_start"], s["row_start"] + s["n_rows"]
        got_main, got_deep = self.r.rows(room, item)
        bad = int((got_main != main[a:b]).any(axis=1).sum() + (got_deep != deep[a:b]).any(axis=1).sum())
        if bad:
            canary = int((got_main == CANARY * 0x101).all(axis=1).sum())
            self.violation(f"room {room} item {item}: {bad} rows of [{a}, {b}) differ from the sim "
                           f"tower's (of which {canary} main rows still canary) after success", "wrong_rows")

    def check_canaries(self, room: int) -> None:
        rec = self.rooms[room]
        if rec.released:
            return
        for i, snap in rec.snaps.items():
            s = self.r.shards[(room, i)]
            now = self.r.buffer[s.offset:s.offset + s.nbytes]
            changed = int((now != snap).sum())
            if changed:
                self.violation(f"room {room} item {i}: {changed} bytes written after its failed status "
                               f"({rec.failed!r})", "wrong_rows")
        self.release(room, rec)

    def release(self, room: int, rec: RxRoom) -> None:
        for i in rec.shards:
            s = self.r.shards[(room, i)]
            self.r.buffer[s.offset:s.offset + s.nbytes] = CANARY
        self.r.release(room)
        rec.released = True
        rec.snaps.clear()

    def finish(self) -> None:
        from ipc import transport

        while self.quarantine:
            self.check_canaries(self.quarantine.popleft()[1])
        self.r.close()
        self.conn.send(("final", {"registered_after_close": len(self.r.engine.registered),
                                  "engines_leaked": len(transport.LEAKED)}))


def receiver_main(rx_id: str, bootstrap: str, conn, buffer_bytes: int) -> None:
    """Entry point of a receiver process (spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides
    logging.basicConfig(level=logging.ERROR)
    try:
        rx = ChaosReceiver(rx_id, bootstrap, conn, buffer_bytes)
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
    conn.send(("ready", os.getpid(), rx.r.engine.session, rx.r.status_endpoint, rx.r.incarnation))
    try:
        rx.run()
    except EOFError:  # the harness is gone
        pass

"""Prefill-side library: receive memory, `register`/`alloc`/`cancel`, status, rows.

A prefill engine can embed it as it is: one Receiver per prefill rank. With many
workers (one per GPU, rooms routed by `client.RoutedClient`), one Receiver registers
with each and sends a room's allocs and cancel to the worker the room went to.
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import zmq

from ipc import wire
from ipc.transport import Engine
from pipeline.peers import curve

MAX_EARLY_FAILED = 65536  # failed statuses kept for rooms not allocated here (yet)

_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass
class Shard:
    room: int
    item: int
    row_start: int
    n_rows: int
    hidden: int
    deepstack_width: int
    dtype: str
    offset: int      # of the main rows in the receive buffer
    ds_offset: int   # of the deepstack rows
    nbytes: int      # both halves


class Receiver:
    """`bootstrap`: one worker's bootstrap endpoint, or a list of several; `alloc`
    then names the room's worker (`worker=`), or `route(room, worker)` does first.

    Rows land in a receive buffer of `buffer_bytes` that the receiver allocates, or in
    `buffer`, one the caller supplies (a C-contiguous uint8 array, such as a view of a
    shared-memory segment that another process maps to read the rows): it is registered
    as it is, and must outlive the receiver.

    With workers that use CurveZMQ: `curve_cert`, this receiver's secret certificate
    (its public half in the workers' curve_clients), and `worker_cert`, the workers'
    public certificate. The receiver registers under its key, and its status socket is
    then a CURVE server with the same key that admits the worker's key alone.

    `require_digest`: a `success` without a digest that matches the rows here fails its
    room ("success without a digest"), for anyone who reaches the status socket could
    send one, and a forged success would conclude a room with rows nobody wrote. None
    (the default): required once a worker has said, in answer to the register, that it
    speaks 1.1 (its successes all carry digests). Pass False for workers that speak 1.0
    alongside those that speak 1.1."""

    def __init__(self, receiver_id: str, bootstrap: str | list[str], *, buffer_bytes: int = 256 << 20,
                 buffer: np.ndarray | None = None,
                 hostname: str = "127.0.0.1", protocol_name: str = "tcp",
                 status_endpoint: str | None = None, ctx: zmq.Context | None = None,
                 register_every_s: float = 60.0, query_after_s: float | None = 30.0,
                 incarnation: int | None = None, curve_cert: str | None = None,
                 worker_cert: str | None = None, self_describing: bool = False,
                 require_digest: bool | None = None):
        self.id = receiver_id
        self.require_digest = require_digest
        self.worker_speaks: str | None = None  # what a worker said in its hello (1.1)
        self.digests_missing = 0
        # (1.1) Each alloc carries this receiver's session and status, so a worker that
        # restarted and lost its registrations registers it from the alloc itself instead
        # of dropping it as "from unregistered receiver"; and a query is preceded by a
        # register, so that a restarted worker answers it ("unknown room") at all.
        self.self_describing = self_describing
        self.curve_keys = curve.peer_keys(curve_cert, worker_cert)
        # (protocol 1.1) This process among those that ran under this id and session: allocs
        # a predecessor sent are then never written into this one's memory.
        self.incarnation = time.time_ns() if incarnation is None else incarnation
        # A room not concluded here that heard nothing for this long is queried (1.1): a
        # status lost on the way (a killed reaper, a socket's queue) comes again.
        self.query_after_s = query_after_s
        self.heard_at: dict[int, float] = {}  # room -> when last sent or heard anything of it
        self._query_check_at = 0.0
        self.queries_sent = 0
        self.recovered_by_query = 0  # statuses that came only as a query's repeat
        self.digest_mismatches = 0
        self.mismatched: set[int] = set()  # rooms failed here for a digest mismatch
        # A worker lets a registration that owns no room expire after a while idle (its
        # registration_idle_s), or give way to newer ones when its table is full: an alloc
        # this long after the last register goes behind a fresh one, so that it is never
        # dropped as "from unregistered receiver" (a register repeated unchanged changes nothing).
        self.register_every_s = register_every_s
        self.registered_at: dict[str, float] = {}  # bootstrap endpoint -> when last registered
        self.engine = Engine(hostname, protocol_name)
        if buffer is None:
            raw = np.empty(buffer_bytes + 4096, dtype=np.uint8)
            raw.fill(0)  # touch every page now: writes into unfaulted pages run slower
            start = (-raw.ctypes.data) % 4096
            buffer = raw[start:start + buffer_bytes]
        elif buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous or not buffer.size:
            raise ValueError(f"receiver {receiver_id}: buffer must be a non-empty C-contiguous 1-D uint8 "
                             f"array, got {buffer.dtype} of shape {buffer.shape}")
        buffer_bytes = buffer.size
        self.buffer = buffer
        self.address = self.buffer.ctypes.data
        self.engine.register(self.address, buffer_bytes)
        self._free = [(0, buffer_bytes)]  # (offset, length), sorted
        # With CURVE a context of its own: its ZAP handler is stopped with it, at close.
        self.own_ctx = zmq.Context() if ctx is None and self.curve_keys is not None else None
        self.ctx = ctx or self.own_ctx or zmq.Context.instance()
        self.workers: dict[str, zmq.Socket] = {}  # bootstrap endpoint -> socket to it
        self.room_worker: dict[int, str] = {}     # room -> the bootstrap endpoint of its worker
        self.status_sock = self.ctx.socket(zmq.PULL)
        self.status_sock.setsockopt(zmq.LINGER, 0)
        self.status_sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a status is tiny; a peer sending more is cut off
        if self.curve_keys is not None:
            own, worker = self.curve_keys
            curve.serve(self.status_sock, curve.ServerKeys(own, frozenset([worker])))
        if status_endpoint is None:
            port = self.status_sock.bind_to_random_port(f"tcp://{hostname}")
            status_endpoint = f"tcp://{hostname}:{port}"
        else:
            self.status_sock.bind(status_endpoint)
        self.status_endpoint = status_endpoint
        self.shards: dict[tuple[int, int], Shard] = {}
        self.success: set[tuple[int, int]] = set()
        self.failed: dict[int, str] = {}
        self.violations: list[str] = []  # protocol breaches seen on the status socket (the first 1000)
        self.dropped = Counter()  # statuses not applied, by kind (breaches and rooms never allocated)
        # `failed` for rooms not allocated here (yet): a worker that does not know who
        # allocated tells every receiver, once; one that allocates later hears nothing more.
        self.early_failed: OrderedDict[int, dict] = OrderedDict()
        self._heard_early: list[dict] = []  # early statuses of rooms allocated since: poll() returns them
        for endpoint in [bootstrap] if isinstance(bootstrap, str) else bootstrap:
            self.add_worker(endpoint)

    # ------------------------------------------------------------ bootstrap
    def add_worker(self, bootstrap: str) -> None:
        """Connect to one more worker and register with it."""
        if bootstrap in self.workers:
            raise ValueError(f"receiver {self.id}: worker {bootstrap} is already added")
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        if self.curve_keys is not None:
            curve.connect_as(sock, *self.curve_keys)
        sock.connect(bootstrap)
        self.workers[bootstrap] = sock
        self._register_with(bootstrap)

    def remove_worker(self, bootstrap: str) -> None:
        """Stop talking to a worker (taken off the ring); rooms routed to it stay routed."""
        self.workers.pop(bootstrap).close()
        self.registered_at.pop(bootstrap, None)

    def _send(self, msg: dict, worker: str) -> None:
        self.workers[worker].send(wire.encode({"v": wire.VERSION, "receiver": self.id, **msg}))

    def _register_msg(self) -> dict:
        return {"type": "register", "session": self.engine.session, "status": self.status_endpoint,
                "incarnation": self.incarnation, "hello": True}

    def register(self) -> None:
        """(Re-)register with every worker."""
        for worker in self.workers:
            self._register_with(worker)

    def _register_with(self, worker: str) -> None:
        self._send(self._register_msg(), worker)
        self.registered_at[worker] = time.monotonic()

    def route(self, room: int, worker: str) -> None:
        """Send this room's allocs and cancel to `worker` (a bootstrap endpoint)."""
        if worker not in self.workers:
            raise ValueError(f"receiver {self.id}: room {room} routed to {worker}, which is not one of its "
                             f"workers ({', '.join(self.workers)}); add_worker() it first")
        self.room_worker[room] = worker

    def worker_of(self, room: int) -> str:
        """The worker a room's messages go to: its route, else the only worker."""
        worker = self.room_worker.get(room)
        if worker is not None:
            if worker not in self.workers:
                raise ValueError(f"receiver {self.id}: room {room}'s worker {worker} was removed")
            return worker
        if len(self.workers) == 1:
            return next(iter(self.workers))
        raise ValueError(f"receiver {self.id}: room {room} has no worker and there are {len(self.workers)}; "
                         f"pass worker= to alloc (the endpoint RoutedClient.encode returned) or route() it")

    def alloc(self, room: int, item: int, *, span: int, hidden: int, dtype: str,
              deepstack_width: int = 0, fanout: int = 1, row_start: int = 0,
              n_rows: int | None = None, worker: str | None = None) -> Shard:
        if worker is not None:
            self.route(room, worker)
        worker = self.worker_of(room)
        n_rows = span - row_start if n_rows is None else n_rows
        isz = wire.DTYPES[dtype]
        main_bytes = n_rows * hidden * isz
        nbytes = n_rows * (hidden + deepstack_width) * isz
        offset = self._take(nbytes) if nbytes else 0
        shard = Shard(room, item, row_start, n_rows, hidden, deepstack_width, dtype,
                      offset, offset + main_bytes, nbytes)
        self.shards[(room, item)] = shard
        if time.monotonic() - self.registered_at.get(worker, 0.0) > self.register_every_s:
            self._register_with(worker)
        early = self.early_failed.pop(room, None)
        if early is not None and room not in self.failed:
            self.failed[room] = early["reason"]
            self._heard_early.append(early)
        self._send({"type": "alloc", "room": room, "item": item,
                    "dst": self.address + offset if n_rows else 0,
                    "dst_deepstack": self.address + shard.ds_offset if n_rows and deepstack_width else 0,
                    "row_start": row_start, "n_rows": n_rows, "span": span, "hidden": hidden,
                    "dtype": dtype, "deepstack_width": deepstack_width, "fanout": fanout,
                    "incarnation": self.incarnation, **self._described()}, worker)
        self.heard_at[room] = time.monotonic()
        return shard

    def _described(self) -> dict:
        if not self.self_describing:
            return {}
        return {"session": self.engine.session, "status": self.status_endpoint}

    def cancel(self, room: int) -> None:
        self._send({"type": "cancel", "room": room}, self.worker_of(room))

    # ------------------------------------------------------------ status
    def poll(self, timeout: float = 0.0) -> list[dict]:
        self._query_silent()
        out, self._heard_early = self._heard_early, []
        if self.status_sock.poll(int(timeout * 1000)):
            while True:
                try:
                    frame = self.status_sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                st = self._on_status(frame)
                if st is not None:
                    out.append(st)
        return out

    def _query_silent(self) -> None:
        """Query each room not concluded here that heard nothing for query_after_s."""
        now = time.monotonic()
        if self.query_after_s is None or now < self._query_check_at:
            return
        self._query_check_at = now + min(1.0, self.query_after_s / 4)
        waiting = {room for room, item in self.shards if room not in self.failed and (room, item) not in self.success}
        for room in waiting:
            if now - self.heard_at.get(room, now) >= self.query_after_s:
                self.query(room)

    def query(self, room: int) -> None:
        """(1.1) Ask the room's worker to repeat what it told this receiver of it."""
        self.heard_at[room] = time.monotonic()
        self.queries_sent += 1
        worker = self.worker_of(room)
        if self.self_describing:
            self._register_with(worker)
        self._send({"type": "query", "room": room}, worker)
    def _on_status(self, frame: bytes) -> dict | None:
        """Apply one status; None if it is not applied (counted in `dropped`). Anyone who
        reaches the status socket can send one, so nothing is taken on trust."""
        try:
            st = wire.decode(frame)
        except wire.ProtocolError as e:
            return self._reject("unparseable", f"unparseable status: {e}")
        if st.get("type") == "hello":  # (1.1) only ever makes the checks stricter
            if st.get("speaks") == wire.SPEAKS:
                self.worker_speaks = wire.SPEAKS
            return None
        room, item, state, reason = st.get("room"), st.get("item"), st.get("state"), st.get("reason")
        digest, repeat = st.get("digest"), st.get("repeat", False)
        if (st.get("type") != "status" or not wire.is_u64(room) or state not in ("success", "failed")
                or not isinstance(reason, str) or not (item is None or wire.is_u64(item))
                or not (digest is None or isinstance(digest, bytes) and len(digest) == wire.DIGEST_BYTES)
                or type(repeat) is not bool):
            return self._reject("malformed", f"malformed status for room {str(room)[:40]} "
                                             f"(state {str(state)[:20]}, item {str(item)[:20]})")
        if room in self.mismatched:  # failed here already: what the worker says of it changes nothing
            self.dropped["after digest mismatch"] += 1
            return None
        if repeat and (room in self.failed or state == "success" and (room, item) in self.success):
            self.dropped["repeat"] += 1  # a query's answer to a status that did come
            return None
        if room in self.heard_at:
            self.heard_at[room] = time.monotonic()
        st = self._apply(st, room, item, state, reason, digest)
        if st is not None and repeat:
            self.recovered_by_query += 1
        return st

    def _apply(self, st: dict, room: int, item, state: str, reason: str, digest: bytes | None) -> dict | None:
        if state == "success":
            if (room, item) not in self.shards:
                return self._reject("no shard", f"success for room {room} item {item}, which this "
                                                f"receiver holds no shard of")
            if room in self.failed:
                return self._reject("after failed", f"success for room {room} item {item} after failed")
            if (room, item) in self.success:
                return self._reject("second success", f"second success for room {room} item {item}")
            if digest is None and self.digest_required:
                self._reject("no digest", f"success for room {room} item {item} without a digest")
                self.digests_missing += 1
                self.mismatched.add(room)
                self.failed[room] = "success without a digest (require_digest): its rows are not known to be written"
                return {**st, "state": "failed", "reason": self.failed[room]}
            if digest is not None and not self.digest_agrees(room, item, digest):
                # Rows that are not what the worker wrote (bytes of another room landed
                # over them, or the memory was reused too early): never used.
                self.digest_mismatches += 1
                self.mismatched.add(room)
                self.failed[room] = "digest mismatch"
                return {**st, "state": "failed", "reason": "digest mismatch"}
            self.success.add((room, item))
        else:
            if room in self.failed:
                return self._reject("second failed", f"second failed for room {room}")
            if not any(key[0] == room for key in self.shards):
                # Not a breach: a worker whose sender died tells every receiver. Kept (a
                # bounded while) in case this receiver allocates for the room after all.
                self.dropped["never allocated"] += 1
                self.early_failed[room] = st
                if len(self.early_failed) > MAX_EARLY_FAILED:
                    self.early_failed.popitem(last=False)
                return None
            self.failed[room] = reason
        return st

    @property
    def digest_required(self) -> bool:
        return self.require_digest if self.require_digest is not None else self.worker_speaks == wire.SPEAKS

    def digest_agrees(self, room: int, item: int, digest: bytes) -> bool:
        """Do this receiver's rows of (room, item) hash to `digest` (a success's, protocol 1.1)?"""
        s = self.shards[(room, item)]
        isz = wire.DTYPES[s.dtype]
        main = self.buffer[s.offset:s.offset + s.n_rows * s.hidden * isz]
        deep = self.buffer[s.ds_offset:s.ds_offset + s.n_rows * s.deepstack_width * isz]
        return wire.rows_digest((main, deep)) == digest

    def _reject(self, kind: str, text: str) -> None:
        self.dropped[kind] += 1
        if len(self.violations) < 1000:
            self.violations.append(text)
        return None

    def concluded(self, room: int, n_items: int) -> bool:
        return room in self.failed or all((room, i) in self.success for i in range(n_items))

    def wait(self, rooms: dict[int, int], timeout: float) -> bool:
        """Wait until every room (room -> its item count) has concluded here."""
        end = time.monotonic() + timeout
        while True:
            if all(self.concluded(r, n) for r, n in rooms.items()):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(left, 0.1))

    # ------------------------------------------------------------ rows
    def rows(self, room: int, item: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Copies of the item's rows that this receiver holds (main, deepstack or None)."""
        s = self.shards[(room, item)]
        dt = _NP[s.dtype]
        isz = wire.DTYPES[s.dtype]
        main = self.buffer[s.offset:s.offset + s.n_rows * s.hidden * isz].view(dt).reshape(s.n_rows, s.hidden)
        deep = None
        if s.deepstack_width:
            deep = self.buffer[s.ds_offset:s.ds_offset + s.n_rows * s.deepstack_width * isz].view(dt)
            deep = deep.reshape(s.n_rows, s.deepstack_width).copy()
        return main.copy(), deep

    def release(self, room: int) -> None:
        """Give back the buffers of a concluded room (after its status: nothing can write there)."""
        for key in [k for k in self.shards if k[0] == room]:
            s = self.shards.pop(key)
            if s.nbytes:
                self._give(s.offset, s.nbytes)
            self.success.discard(key)
        self.room_worker.pop(room, None)
        self.heard_at.pop(room, None)
        self.mismatched.discard(room)

    def _take(self, n: int) -> int:
        n = (n + 63) & ~63
        for i, (off, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    self._free.pop(i)
                else:
                    self._free[i] = (off + n, length - n)
                return off
        raise MemoryError(f"receiver {self.id}: no {n} contiguous bytes free in its receive buffer")

    def _give(self, off: int, n: int) -> None:
        n = (n + 63) & ~63
        self._free.append((off, n))
        self._free.sort()
        merged = [self._free[0]]
        for o, n in self._free[1:]:
            po, pl = merged[-1]
            if po + pl == o:
                merged[-1] = (po, pl + n)
            else:
                merged.append((o, n))
        self._free = merged

    def close(self) -> None:
        for sock in self.workers.values():
            sock.close()
        self.status_sock.close()
        if self.own_ctx is not None:
            curve.stop(self.own_ctx)
            self.own_ctx.term()
        self.engine.close()

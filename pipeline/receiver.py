"""Prefill-side library: receive memory, `register`/`alloc`/`cancel`, status, rows.

A prefill engine can embed it as it is: one Receiver per prefill rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import zmq

from pipeline import protocol
from pipeline.transport import Engine

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
    def __init__(self, receiver_id: str, bootstrap: str, *, buffer_bytes: int = 256 << 20,
                 hostname: str = "127.0.0.1", protocol_name: str = "tcp",
                 status_endpoint: str | None = None, ctx: zmq.Context | None = None):
        self.id = receiver_id
        self.engine = Engine(hostname, protocol_name)
        raw = np.empty(buffer_bytes + 4096, dtype=np.uint8)
        raw.fill(0)  # touch every page now: writes into unfaulted pages run ~5x slower
        start = (-raw.ctypes.data) % 4096
        self.buffer = raw[start:start + buffer_bytes]
        self.address = self.buffer.ctypes.data
        self.engine.register(self.address, buffer_bytes)
        self._free = [(0, buffer_bytes)]  # (offset, length), sorted
        self.ctx = ctx or zmq.Context.instance()
        self.boot = self.ctx.socket(zmq.PUSH)
        self.boot.setsockopt(zmq.LINGER, 2000)
        self.boot.connect(bootstrap)
        self.status_sock = self.ctx.socket(zmq.PULL)
        self.status_sock.setsockopt(zmq.LINGER, 0)
        if status_endpoint is None:
            port = self.status_sock.bind_to_random_port(f"tcp://{hostname}")
            status_endpoint = f"tcp://{hostname}:{port}"
        else:
            self.status_sock.bind(status_endpoint)
        self.status_endpoint = status_endpoint
        self.shards: dict[tuple[int, int], Shard] = {}
        self.success: set[tuple[int, int]] = set()
        self.failed: dict[int, str] = {}
        self.violations: list[str] = []  # protocol breaches seen from the worker
        self.register()

    # ------------------------------------------------------------ bootstrap
    def _send(self, msg: dict) -> None:
        self.boot.send(protocol.encode({"v": protocol.VERSION, "receiver": self.id, **msg}))

    def register(self) -> None:
        self._send({"type": "register", "session": self.engine.session, "status": self.status_endpoint})

    def alloc(self, room: int, item: int, *, span: int, hidden: int, dtype: str,
              deepstack_width: int = 0, fanout: int = 1, row_start: int = 0,
              n_rows: int | None = None) -> Shard:
        n_rows = span - row_start if n_rows is None else n_rows
        isz = protocol.DTYPES[dtype]
        main_bytes = n_rows * hidden * isz
        nbytes = n_rows * (hidden + deepstack_width) * isz
        offset = self._take(nbytes) if nbytes else 0
        shard = Shard(room, item, row_start, n_rows, hidden, deepstack_width, dtype,
                      offset, offset + main_bytes, nbytes)
        self.shards[(room, item)] = shard
        self._send({"type": "alloc", "room": room, "item": item,
                    "dst": self.address + offset if n_rows else 0,
                    "dst_deepstack": self.address + shard.ds_offset if n_rows and deepstack_width else 0,
                    "row_start": row_start, "n_rows": n_rows, "span": span, "hidden": hidden,
                    "dtype": dtype, "deepstack_width": deepstack_width, "fanout": fanout})
        return shard

    def cancel(self, room: int) -> None:
        self._send({"type": "cancel", "room": room})

    # ------------------------------------------------------------ status
    def poll(self, timeout: float = 0.0) -> list[dict]:
        out = []
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

    def _on_status(self, frame: bytes) -> dict | None:
        try:
            st = protocol.decode(frame)
        except protocol.ProtocolError as e:
            self.violations.append(f"unparseable status: {e}")
            return None
        room, item = st.get("room"), st.get("item")
        if st.get("state") == "success":
            if room in self.failed:
                self.violations.append(f"success for room {room} item {item} after failed")
            elif (room, item) in self.success:
                self.violations.append(f"second success for room {room} item {item}")
            self.success.add((room, item))
        else:
            if room in self.failed:
                self.violations.append(f"second failed for room {room}")
            self.failed[room] = st.get("reason", "")
        return st

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
        isz = protocol.DTYPES[s.dtype]
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
        for o, l in self._free[1:]:
            po, pl = merged[-1]
            if po + pl == o:
                merged[-1] = (po, pl + l)
            else:
                merged.append((o, l))
        self._free = merged

    def close(self) -> None:
        self.boot.close()
        self.status_sock.close()
        self.engine.close()

"""A thin, honest wrapper over the Mooncake transfer engine (one-sided writes).

Used by the worker's sender (``register_source``, ``submit``/``poll``) and by the
prefill-side receiver library (``register``). The facts it is built on were measured
against mooncake-transfer-engine 0.3.13.post1 over TCP, and read in Mooncake's source:

* ``initialize(host, "P2PHANDSHAKE", protocol, device)`` returns 0 even for an unknown
  protocol or an unresolvable host (so this wrapper checks both) and picks a random
  RPC port, ignoring any in ``host``; peers address us as ``"host:get_rpc_port()"``.
* Registered memory is served to any peer: the RPC port answers every handshake with
  the registered buffers (``get_first_buffer_address``), the TCP data port serves
  reads and writes anywhere inside them, and over RDMA a registered region is an MR
  with remote read and write rights whose rkey that handshake hands out. Both ports
  bind every interface whatever ``host`` is (the library has no setting for it;
  MC_TCP_BIND_ADDRESS only names the address it advertises under a metadata server).
  Over TCP only a write's destination is checked (by the peer), so a source needs no
  registration and the sender registers none; over RDMA the NIC needs the source
  registered, which exposes it (``register_source``).
* ``transfer_check_status(batch)`` does not block (``transfer_sync_write`` busy-spins
  a core) but reads task 0 only and frees the batch once it has ended, so each entry
  is its own ``transfer_submit_write`` batch, never asked again after its end.
* ``transfer_submit_write`` performs the P2P handshake with a new peer inline: it
  fails at once for a dead peer, but blocks for ~60 s for a peer that accepts TCP
  and does not answer, *holding the engine-wide lock*, so writes to every other peer
  wait too. ``send_probe`` blocks as long but takes no lock. So a new (or failed)
  session is probed first, and ``submit`` never calls the library in the caller's
  thread: a small dispatcher pool does, serialised per session, so a hung peer holds
  one dispatcher thread and delays only its own writes.
* A transfer that stops making progress fails after ``MC_TCP_PROGRESS_TIMEOUT_SEC``
  (library default 30 s; ``Engine(progress_timeout_s=...)`` sets it); a write to a
  SIGKILLed peer, or outside the peer's registered memory, fails at once.
* A failed write may have landed partly (a stalled peer that resumes reads what was
  in its socket): ``False`` means "not known complete", never "nothing was written".
* Engines do not survive ``fork``: an inherited engine hangs. Create one per process
  (spawn, or after fork); this wrapper refuses to be used from another pid.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ipc import mooncake_log

__all__ = ["Engine", "Pending", "TransportError"]

_PROTOCOLS = ("tcp", "rdma")
_HANDSHAKE_STALL_S = 60.0  # measured: handshake with a hung peer blocks ~60 s
_SESSION_FAIL_MEMO_S = 2.0  # queued writes to a peer whose open just failed fail fast
# Writes the library holds for one peer at most: a burst of thousands at once makes
# Mooncake's TCP transport stall or drop some of them; the rest wait in their queue.
MAX_WRITES_IN_FLIGHT = 128
_POLL_SLEEP_MIN = 50e-6
_POLL_SLEEP_MAX = 2e-3

log = logging.getLogger("epd.transport")

# Engines whose teardown would have raced a library call still in progress are
# kept alive here instead of being destroyed under it.
LEAKED: list = []


class TransportError(RuntimeError):
    """A Mooncake engine could not be set up, or a transfer failed."""


def _load_engine_class():
    mooncake_log.set_level_before_loading()
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransportError(
            "the Mooncake transfer engine is not installed (import mooncake.engine "
            f"failed: {e}); install the package with the extra for this machine's CUDA: "
            "[cpu], [cuda12] or [cuda13] (scripts/setup.sh picks it)"
        ) from None
    return TransferEngine


def _has_rdma_devices(te) -> bool:
    try:
        topo = json.loads(te.get_local_topology())
    except Exception:
        return False

    def any_name(x) -> bool:
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, (list, tuple)):
            return any(any_name(v) for v in x)
        return isinstance(x, str) and bool(x)

    return any_name(topo)


def _batch_ok(bid) -> bool:
    # 0 on failure in this version; older bindings return -1 (as a u64).
    return isinstance(bid, int) and 0 < bid < (1 << 63)


class Pending:
    """One ``submit``: its writes, each a single-entry Mooncake batch.

    ``poll()`` is None while any write may still be in flight, then True (all
    complete) or False (at least one failed; ``error`` says why). It never reports
    a result while the library still owns one of the writes, except past the
    engine's backstop deadline, which the library's own timeouts should make
    unreachable and whose error says so.
    """

    def __init__(self, engine: "Engine", session: str, entries: list[tuple[int, int, int]], deadline: float):
        self.session = session
        self.error = ""
        self.nbytes = sum(e[2] for e in entries)
        self._engine = engine
        self._entries = entries
        self._deadline = deadline
        self._lock = threading.Lock()
        self._ids: list[int] = []  # batch ids not yet terminal
        self._dispatched = False
        self._abandoned = False
        self._failures: list[str] = []
        self._result: bool | None = None
        self._counted = 0  # its writes in the engine's per-peer count (Engine._drain)

    # -- dispatcher side ---------------------------------------------------
    def _dispatch(self, te) -> None:
        """Hand every entry to the library (may block in the handshake)."""
        failure = self._engine._session_failed_recently(self.session)
        if not failure and any(e[2] for e in self._entries):
            failure = self._engine._open(te, self.session)
        for i, (src, dst, n) in enumerate(self._entries):
            if failure:
                break
            with self._lock:
                if self._abandoned:
                    break
            if n == 0:
                continue
            bid = te.transfer_submit_write(self.session, src, dst, n)
            if not _batch_ok(bid):
                failure = (
                    f"peer {self.session} unreachable: the transfer engine could "
                    f"not open the session or start write {i} ({n} bytes)"
                )
                self._engine._note_session_failure(self.session, failure)
                break
            with self._lock:
                if self._abandoned:
                    self._engine._orphan(bid)
                else:
                    self._ids.append(bid)
        with self._lock:
            if failure:
                self._failures.append(failure)
            self._dispatched = True

    # -- caller side -------------------------------------------------------
    def poll(self) -> bool | None:
        """None while writes may be in flight; True if all completed; False if any failed."""
        if self._result is not None:
            return self._result
        self._engine._check_pid()
        te = self._engine._te
        if te is None:
            self._abandon("the engine was closed while the write was in flight")
            return self._result
        with self._lock:
            if self._result is not None:
                return self._result
            still = []
            for bid in self._ids:
                s = te.transfer_check_status(bid)
                if s == 0:
                    still.append(bid)
                elif s == 1:
                    pass  # completed; the library freed the batch
                elif s == -1:  # failed; the library freed the batch
                    self._failures.append(self._write_failed_reason())
                    self._engine._forget(self.session)
                else:  # -2 (timeout): not freed by the library
                    self._failures.append(f"write to {self.session} timed out in the transfer engine (status {s})")
            self._ids = still
            if self._dispatched and not self._ids:
                return self._finish(not self._failures)
            if time.monotonic() > self._deadline:
                self._abandoned = True
                for bid in self._ids:
                    self._engine._orphan(bid)
                self._ids = []
                self._failures.append(
                    f"peer {self.session} unreachable: no completion within "
                    f"{self._engine.backstop_s:.0f} s (the transfer engine has not released "
                    f"the write; it may still land)"
                )
                return self._finish(False)
            return None

    def _write_failed_reason(self) -> str:
        return (
            f"write to {self.session} failed: peer unreachable or gone, connection "
            f"dropped or stalled, or destination outside the peer's registered memory "
            f"(the Mooncake log on stderr has the detail)"
        )

    def _finish(self, ok: bool) -> bool:
        if not ok:
            first = self._failures[0] if self._failures else "write failed"
            more = len(self._failures) - 1
            self.error = first + (f" (+{more} more failed writes)" if more > 0 else "")
        self._result = ok
        self._engine._pending_done(self)
        return ok

    def _abandon(self, why: str) -> None:
        with self._lock:
            if self._result is not None:
                return
            self._abandoned = True
            for bid in self._ids:
                self._engine._orphan(bid)
            self._ids = []
            self._failures.append(f"write to {self.session}: {why}; it may still land")
            self._finish(False)

    @property
    def done(self) -> bool:
        return self._result is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Poll until done; False on failure or when ``timeout`` (s) passes first."""
        end = None if timeout is None else time.monotonic() + timeout
        sleep = _POLL_SLEEP_MIN
        while True:
            r = self.poll()
            if r is not None:
                return r
            now = time.monotonic()
            if end is not None and now >= end:
                return False
            nap = sleep if end is None else min(sleep, end - now)
            time.sleep(max(nap, 0.0))
            sleep = min(sleep * 2, _POLL_SLEEP_MAX)


class Engine:
    """One Mooncake transfer engine (P2P handshake, no metadata server).

    ``session`` ("host:rpc_port") is what peers write to. ``register`` makes local
    memory a write target, ``register_source`` a write source (see the module note
    on who can then read it). ``write`` blocks; ``submit`` returns a ``Pending``.

    ``progress_timeout_s`` sets MC_TCP_PROGRESS_TIMEOUT_SEC (and the status timeout)
    in the process environment, which the library reads when an engine is created:
    a stalled transfer fails after that long (library default 30 s). It is process
    wide, like all of Mooncake's MC_* settings. ``dispatch_threads`` bounds how many
    peers can be in a (possibly ~60 s) handshake at once before ``submit``s to other
    peers wait for a free dispatcher.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        *,
        progress_timeout_s: int | None = None,
        dispatch_threads: int = 4,
    ):
        self._pid = os.getpid()
        self._te: Any = None  # mooncake's TransferEngine (untyped); None until made, and once closed
        self._closed = True
        if protocol not in _PROTOCOLS:
            raise TransportError(f"unknown Mooncake protocol {protocol!r}: expected one of {', '.join(_PROTOCOLS)}")
        if not isinstance(hostname, str) or not hostname or ":" in hostname:
            raise TransportError(
                f"hostname {hostname!r} must be a bare host name or IPv4 address: the engine "
                f"picks its own RPC port and peers write to the session 'host:port'"
            )
        try:
            socket.getaddrinfo(hostname, None)
        except OSError as e:
            raise TransportError(
                f"hostname {hostname!r} does not resolve ({e}); peers would not reach this "
                f"engine at it — pass an IP address of this machine"
            ) from None
        if progress_timeout_s is not None:
            if progress_timeout_s < 1:
                raise TransportError("progress_timeout_s must be >= 1")
            os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(int(progress_timeout_s))
            os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] = str(int(progress_timeout_s))
        progress = float(os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC") or 30)
        # Longest the library may legitimately hold a write: a handshake with a hung
        # peer, then a stalled transfer, then slack for reconnect cool-downs.
        self.backstop_s = _HANDSHAKE_STALL_S + progress + 30.0

        cls = _load_engine_class()
        with mooncake_log.quiet_setup():
            try:
                te = cls()
                rc = te.initialize(hostname, "P2PHANDSHAKE", protocol, device)
            except Exception as e:
                raise TransportError(
                    f"Mooncake initialize(hostname={hostname!r}, protocol={protocol!r}, device={device!r}) raised {e!r}"
                ) from e
        if rc != 0:
            raise TransportError(
                f"Mooncake initialize(hostname={hostname!r}, protocol={protocol!r}, "
                f"device={device!r}) failed with code {rc}: it could not bind its RPC or data "
                f"port (ports in use, or MC_MIN_RPC_PORT/MC_MAX_RPC_PORT too narrow) or set up "
                f"the transport; Mooncake's own log of it is on stderr at log level DEBUG"
            )
        if protocol == "rdma" and not _has_rdma_devices(te):
            del te  # nothing in flight yet: safe to destroy
            raise TransportError(
                "protocol 'rdma' requested but Mooncake found no RDMA devices on this machine "
                "(it would silently fall back to TCP); use protocol 'tcp', or check "
                f"the device filter {device!r} and the RDMA drivers"
            )
        port = te.get_rpc_port()
        self._te = te
        self.hostname = hostname
        self.protocol = protocol
        self.session = f"{hostname}:{port}"
        self._lock = threading.Lock()
        self._regs: dict[int, int] = {}
        self._queues: dict[str, deque[Pending]] = {}
        self._active: set[str] = set()
        self._busy_threads = 0
        self._session_fail: dict[str, tuple[float, str]] = {}
        self._opened: set[str] = set()
        self._inflight: set[Pending] = set()
        self._writes_in_flight: dict[str, int] = {}  # per peer: dispatched by _drain, not yet done
        self._write_done = threading.Condition(self._lock)
        self._orphans: list[int] = []
        self._pool = ThreadPoolExecutor(max_workers=max(1, dispatch_threads), thread_name_prefix="mooncake-submit")
        self._closed = False

    # -- memory ------------------------------------------------------------
    def register(self, address: int, length: int) -> None:
        """Make local memory a write target: peers write into it, and any peer that
        reaches this engine can read it too."""
        self._usable()
        if address <= 0 or length <= 0:
            raise TransportError(f"cannot register address {address:#x} length {length}: both must be positive")
        with self._lock:
            for a, n in self._regs.items():
                if address < a + n and a < address + length:
                    raise TransportError(f"region {address:#x}+{length} overlaps registered region {a:#x}+{n}")
            rc = self._te.register_memory(address, length)
            if rc != 0:
                raise TransportError(f"Mooncake register_memory({address:#x}, {length}) failed with code {rc}")
            self._regs[address] = length

    def register_source(self, address: int, length: int) -> None:
        """Make local memory a source of this engine's writes. Over TCP nothing is
        registered, so no peer can read or write it through us; over RDMA the NIC
        needs it registered, and then every peer that reaches this engine can."""
        self._usable()
        if self.protocol == "rdma":
            self.register(address, length)

    def unregister(self, address: int) -> None:
        """Stop accepting writes into the region. Writes into it that are in flight
        are aborted by the library (the sender sees them fail); bytes already
        received stay. Keep the memory mapped until the senders have been told."""
        self._usable()
        with self._lock:
            if address not in self._regs:
                raise TransportError(f"address {address:#x} is not registered with this engine")
            rc = self._te.unregister_memory(address)
            del self._regs[address]
        if rc != 0:
            raise TransportError(f"Mooncake unregister_memory({address:#x}) failed with code {rc}")

    @property
    def registered(self) -> dict[int, int]:
        with self._lock:
            return dict(self._regs)

    # -- writes ------------------------------------------------------------
    def write(self, session: str, src: int, dst: int, length: int) -> None:
        """Write ``length`` bytes from local ``src`` to ``dst`` in the peer's registered
        memory; returns when complete. Blocks at most about ``backstop_s`` (a hung
        peer: ~60 s handshake or the progress timeout); raises TransportError."""
        p = self._make_pending(session, [src], [dst], [length])
        p._dispatch(self._te)  # in this thread: the caller asked to block
        if not p.wait(None):
            raise TransportError(p.error)

    def submit(self, session: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> Pending:
        """Start writes ``srcs[i] -> dsts[i]`` of ``lengths[i]`` bytes to one peer;
        returns at once (the library is called from a dispatcher thread)."""
        p = self._make_pending(session, srcs, dsts, lengths)
        with self._lock:
            self._queues.setdefault(session, deque()).append(p)
            start = session not in self._active
            if start:
                self._active.add(session)
                self._busy_threads += 1
        if start:
            self._pool.submit(self._drain, session)
        return p

    def _make_pending(self, session, srcs, dsts, lengths) -> Pending:
        self._usable()
        if not isinstance(session, str) or not session:
            raise TransportError(f"bad session {session!r}: expected 'host:port'")
        try:
            srcs = [int(x) for x in srcs]
            dsts = [int(x) for x in dsts]
            lengths = [int(x) for x in lengths]
        except (TypeError, ValueError) as e:
            raise TransportError(f"srcs, dsts and lengths must be integers: {e}") from None
        if not (len(srcs) == len(dsts) == len(lengths)):
            raise TransportError(f"srcs, dsts and lengths differ in length ({len(srcs)}, {len(dsts)}, {len(lengths)})")
        for s, d, n in zip(srcs, dsts, lengths):
            if n < 0 or (n and (s <= 0 or d <= 0)):
                raise TransportError(f"bad write src={s:#x} dst={d:#x} length={n}")
        self._reap_orphans()
        p = Pending(self, session, list(zip(srcs, dsts, lengths)), time.monotonic() + self.backstop_s)
        with self._lock:
            self._inflight.add(p)
        return p

    def _drain(self, session: str) -> None:
        try:
            while True:
                with self._lock:
                    q = self._queues.get(session)
                    if not q:
                        self._queues.pop(session, None)
                        self._active.discard(session)
                        self._busy_threads -= 1
                        return
                    p = q.popleft()
                    while self._writes_in_flight.get(session, 0) >= MAX_WRITES_IN_FLIGHT and not self._closed:
                        self._write_done.wait(0.1)
                    p._counted = sum(1 for e in p._entries if e[2])
                    self._writes_in_flight[session] = self._writes_in_flight.get(session, 0) + p._counted
                try:
                    p._dispatch(self._te)
                except BaseException as e:  # never leave a Pending undispatched
                    with p._lock:
                        p._failures.append(f"could not start the write to {session}: {e!r}")
                        p._dispatched = True
        except BaseException:
            with self._lock:
                self._active.discard(session)
                self._busy_threads -= 1
            raise

    def _open(self, te, session: str) -> str:
        """Make sure the library has a handshake with ``session``; '' or why not.

        The library opens a session inside ``transfer_submit_write`` while holding
        its engine-wide lock, so a peer that accepts TCP but never answers stalls
        every write to every peer for ~60 s. ``send_probe`` takes no such lock: a
        hung peer then holds only this dispatcher thread. A dead peer fails at once.
        """
        with self._lock:
            if session in self._opened:
                return ""
        rc = te.send_probe(session)
        if rc != 0:
            why = (
                f"peer {session} unreachable: handshake probe failed with code {rc} "
                f"(-101: host does not resolve, -102: nothing listens there or it "
                f"did not answer)"
            )
            self._note_session_failure(session, why)
            return why
        with self._lock:
            self._opened.add(session)
        return ""

    def _forget(self, session: str) -> None:
        # After a failed write, probe again before the next one: the peer may be
        # gone (then the next write fails at once with a clear reason) or restarted.
        with self._lock:
            self._opened.discard(session)

    def _note_session_failure(self, session: str, reason: str) -> None:
        with self._lock:
            self._session_fail[session] = (time.monotonic(), reason)

    def _session_failed_recently(self, session: str) -> str:
        with self._lock:
            f = self._session_fail.get(session)
        if f and time.monotonic() - f[0] < _SESSION_FAIL_MEMO_S:
            return f[1]
        return ""

    def _pending_done(self, p: Pending) -> None:
        with self._lock:
            self._inflight.discard(p)
            if p._counted:
                left = self._writes_in_flight[p.session] - p._counted
                if left:
                    self._writes_in_flight[p.session] = left
                else:
                    del self._writes_in_flight[p.session]
                p._counted = 0
                self._write_done.notify_all()

    def _orphan(self, bid: int) -> None:
        # Lock order: a Pending's lock, then the engine's.
        with self._lock:
            self._orphans.append(bid)

    def _reap_orphans(self) -> None:
        if not self._orphans:
            return
        with self._lock:
            ids, self._orphans = self._orphans, []
        keep = [b for b in ids if self._te.transfer_check_status(b) == 0]
        with self._lock:
            self._orphans.extend(keep)

    # -- lifecycle ---------------------------------------------------------
    def _check_pid(self) -> None:
        if os.getpid() != self._pid:
            raise TransportError(
                f"this Mooncake engine was created in process {self._pid}; engines do not "
                f"survive fork (calls into an inherited one hang) — create a new Engine in "
                f"process {os.getpid()}"
            )

    def _usable(self) -> None:
        self._check_pid()
        if self._closed:
            raise TransportError("the transfer engine is closed")

    def close(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout``, default ``backstop_s``) for in-flight writes, then
        unregister what remains and destroy the engine. If a library call is still
        running at the deadline the engine is kept alive (leaked), not destroyed under it."""
        if self._closed or self._te is None:
            return
        self._check_pid()
        self._closed = True
        end = time.monotonic() + (self.backstop_s if timeout is None else timeout)
        while True:
            with self._lock:
                pend = list(self._inflight)
                busy = self._busy_threads
            for p in pend:
                p.poll()
            self._reap_orphans()
            with self._lock:
                quiet = not self._inflight and not self._busy_threads and not self._orphans
            if quiet or time.monotonic() >= end:
                break
            time.sleep(0.002 if busy or pend else 0.0)
        self._pool.shutdown(wait=False)
        with self._lock:
            left = list(self._inflight)
        for p in left:
            p._abandon("the engine was closed while the write was in flight")
        te, self._te = self._te, None
        with self._lock:
            regs, self._regs = list(self._regs), {}
        for a in regs:
            te.unregister_memory(a)
        if not quiet:
            LEAKED.append(te)
            return
        del te

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Engine(session={getattr(self, 'session', None)!r}, closed={self._closed})"

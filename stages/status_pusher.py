"""The reaper's status sockets: one ZeroMQ PUSH socket per receiver's status endpoint,
opened when a status is to go there, closed when idle, and capped.

It knows frames and endpoints only; what is told, and to whom, the reaper decides.

Each open socket costs file descriptors (its mailbox, its connection), and anyone who
reaches the bootstrap socket can register receivers: so a socket is opened only for a
status, at most `max_sockets` are open at once, and one unused for `idle_s` is closed.

A status is never lost to a close: a socket is closed only once LINGER_S has passed
since its last status (what ZeroMQ's linger would have granted that status anyway), so
it is closed with linger 0 and gives its file descriptors back at once. When every open
socket was used more recently than that, a status for a receiver without a socket waits
here (bounded) until one may be closed.

With CurveZMQ (`curve`: the worker's key pair), a receiver's status socket is the CURVE
server and the worker its client: the worker connects with the public key the receiver
registered under on the bootstrap socket as the server's key, so statuses reach only
the holder of that key's secret, and the receiver can admit the worker's key alone.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import zmq

# Its warnings are the reaper's: operators find them under the reaper's logger.
log = logging.getLogger("epd.reaper")

LINGER_S = 1.0  # how long a status sent may take to leave: a socket is not closed before
FDS_PER_SOCKET = 2  # its mailbox and its TCP connection
# A socket closed goes on holding its slot in the context (and its descriptors) until
# ZeroMQ's own thread has reaped it, a moment later: room for as many again.
SLOTS_PER_SOCKET = 2


class StatusPusher:
    """PUSH sockets to receivers' status endpoints; never blocks the reaper."""

    def __init__(self, hwm: int = 10000, max_sockets: int = 256, idle_s: float = 60.0, clock=time.monotonic,
                 curve=None):
        self.hwm = hwm
        self.curve = curve  # the worker's key pair (.public, .secret, Z85), or None
        self.max_sockets = max_sockets
        self.idle_s = max(idle_s, LINGER_S)
        self.clock = clock
        # A context of its own: ZeroMQ caps the sockets of a context (1023 by default),
        # and the cap here may be set above what a shared one allows.
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, SLOTS_PER_SOCKET * max_sockets + 8)
        self.endpoints: dict[str, tuple[str, str]] = {}  # receiver -> (status endpoint, its CURVE key)
        self.sockets: OrderedDict[str, tuple[zmq.Socket, tuple[str, str]]] = OrderedDict()  # least recently used first
        self.used_at: dict[str, float] = {}
        # Sockets to endpoints their receivers moved away from, with their last use: the
        # statuses sent there may still be leaving; closed once LINGER_S has passed.
        self.retiring: list[tuple[zmq.Socket, float]] = []
        # Statuses for receivers not known here (yet), or with no socket free: in arrival order.
        self.waiting: OrderedDict[str, list[bytes]] = OrderedDict()
        self.n_waiting = 0
        self.undelivered = 0
        self.opened = 0
        self._logged_no_socket = False

    def register(self, receiver: str, endpoint: str, key: str = "") -> None:
        """Where `receiver`'s statuses go from now on (`key`: its CURVE public key, or ''
        without CURVE). A socket to its old endpoint, if any, stays until idle: statuses
        already sent there may still be on their way."""
        if self.endpoints.get(receiver) == (endpoint, key):
            return
        self.endpoints[receiver] = (endpoint, key)
        if receiver in self.waiting:
            self.flush()

    def forget(self, receiver: str) -> None:
        """`receiver`'s registration expired: its socket closes when idle, as any other;
        statuses still waiting for its endpoint never will have one."""
        self.endpoints.pop(receiver, None)
        for _ in self.waiting.pop(receiver, ()):
            self.n_waiting -= 1
            self._undelivered(receiver, "its registration expired before a socket was free")

    def send(self, receiver: str, frame: bytes) -> None:
        if receiver in self.waiting or not self._send_now(receiver, frame):
            self._hold(receiver, frame)

    def tick(self) -> None:
        """Close idle sockets; send what waited for a socket."""
        now = self.clock()
        still = []
        for sock, used in self.retiring:
            if now - used < LINGER_S:
                still.append((sock, used))
            else:
                sock.close(linger=0)
        self.retiring = still
        while self.sockets:
            receiver = next(iter(self.sockets))
            if now - self.used_at[receiver] < self.idle_s:
                break
            self._close(receiver)
        if self.waiting:
            self.flush()

    def flush(self) -> None:
        """Send what waited, oldest first, as far as sockets allow."""
        for receiver in list(self.waiting):
            frames = self.waiting[receiver]
            while frames and self._send_now(receiver, frames[0]):
                frames.pop(0)
                self.n_waiting -= 1
            if frames:
                if receiver in self.endpoints and self.n_open() >= self.max_sockets:
                    return  # no socket free: the rest wait behind it
                continue
            del self.waiting[receiver]

    def stats(self) -> dict:
        return {"status_undelivered": self.undelivered, "status_sockets_open": self.n_open(),
                "status_sockets_opened": self.opened, "status_waiting": self.n_waiting}

    def n_open(self) -> int:
        return len(self.sockets) + len(self.retiring)

    def _send_now(self, receiver: str, frame: bytes) -> bool:
        """Sent (or dropped, counted, for a full queue); False if it must wait."""
        endpoint = self.endpoints.get(receiver)
        if endpoint is None:
            return False  # a restarted reaper learns the endpoints from the sender a moment later
        sock = self._socket(receiver, endpoint)
        if sock is None:
            return False
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._undelivered(receiver, f"its queue is full (status_hwm {self.hwm})")
        self.used_at[receiver] = self.clock()
        self.sockets.move_to_end(receiver)
        return True

    def _socket(self, receiver: str, endpoint: tuple[str, str]) -> zmq.Socket | None:
        """`receiver`'s socket to `endpoint`, opened if need be; None while none may be."""
        got = self.sockets.get(receiver)
        if got is not None and got[1] == endpoint:
            return got[0]
        if got is not None:  # the receiver moved: statuses sent to the old endpoint may still be leaving
            self.retiring.append((self.sockets.pop(receiver)[0], self.used_at.pop(receiver)))
        if self.n_open() >= self.max_sockets:
            if not self.sockets:
                return None
            oldest = next(iter(self.sockets))
            if self.clock() - self.used_at[oldest] < LINGER_S:
                return None
            self._close(oldest)
        try:
            sock = self.ctx.socket(zmq.PUSH)
        except zmq.ZMQError as e:  # closed sockets not reaped yet, or the process out of files: wait
            if not self._logged_no_socket:
                self._logged_no_socket = True
                log.warning("cannot open a status socket now (%s): statuses wait for one", e)
            return None
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        address, key = endpoint
        try:
            if key and self.curve is not None:
                sock.curve_secretkey, sock.curve_publickey = self.curve.secret, self.curve.public
                sock.curve_serverkey = key.encode()
            sock.connect(address)
        except zmq.ZMQError as e:  # the sender checks endpoints; this one still got past it
            sock.close(linger=0)
            self.endpoints.pop(receiver, None)
            log.warning("receiver %r registered status endpoint %r, which cannot be connected to: %s",
                        receiver, address, e)
            return None
        self.opened += 1
        self.sockets[receiver] = (sock, endpoint)
        self.used_at[receiver] = self.clock()
        return sock

    def _close(self, receiver: str) -> None:
        sock, _ = self.sockets.pop(receiver)
        self.used_at.pop(receiver, None)
        sock.close(linger=0)  # LINGER_S has passed since its last status (see the module's docstring)

    def _hold(self, receiver: str, frame: bytes) -> None:
        held = self.waiting.setdefault(receiver, [])
        if self.n_waiting < self.hwm:
            held.append(frame)
            self.n_waiting += 1
            return
        if not held:
            del self.waiting[receiver]
        self._undelivered(receiver, f"{self.n_waiting} statuses wait for a socket already (status_hwm)")

    def _undelivered(self, receiver: str, why: str) -> None:
        self.undelivered += 1
        if self.undelivered & (self.undelivered - 1) == 0:  # the 1st, 2nd, 4th, 8th...: not one per status
            log.warning("dropped a status for receiver %s: %s; %d statuses dropped so far",
                        receiver, why, self.undelivered)

    def close(self) -> None:
        """Closes with ZeroMQ's linger, so that the last statuses still go out."""
        for sock, _ in self.sockets.values():
            sock.close(linger=int(LINGER_S * 1000))
        for sock, _ in self.retiring:
            sock.close(linger=int(LINGER_S * 1000))
        self.sockets.clear()
        self.retiring = []
        self.ctx.term()

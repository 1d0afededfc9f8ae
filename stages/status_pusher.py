"""The reaper's status sockets: one ZeroMQ PUSH socket per receiver's status endpoint.

It knows frames and endpoints only; what is told, and to whom, the reaper decides.
"""
from __future__ import annotations

import logging

import zmq

# Its warnings are the reaper's: operators find them under the reaper's logger.
log = logging.getLogger("epd.reaper")


class StatusPusher:
    """One PUSH socket per receiver's status endpoint; never blocks the reaper."""

    def __init__(self, ctx: zmq.Context, hwm: int = 10000):
        self.ctx = ctx
        self.hwm = hwm
        self.endpoints: dict[str, str] = {}
        self.sockets: dict[str, zmq.Socket] = {}
        self.waiting: dict[str, list[bytes]] = {}  # for receivers not (yet) known here
        self.undelivered = 0

    def register(self, receiver: str, endpoint: str) -> None:
        if self.endpoints.get(receiver) == endpoint:
            return
        old = self.sockets.pop(receiver, None)
        if old is not None:
            # With its LINGER, not 0: statuses already sent there, still queued while the
            # connection comes up, go out yet. Closing it at once dropped them, and a
            # receiver that moved its status endpoint just after a status never heard it.
            old.close()
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, self.hwm)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:  # the sender checks endpoints; this one still got past it
            sock.close(linger=0)
            log.warning("receiver %r registered status endpoint %r, which cannot be connected to: %s",
                        receiver, endpoint, e)
            return
        self.endpoints[receiver] = endpoint
        self.sockets[receiver] = sock
        for frame in self.waiting.pop(receiver, []):
            self.send(receiver, frame)

    def send(self, receiver: str, frame: bytes) -> None:
        sock = self.sockets.get(receiver)
        if sock is None:
            # A restarted reaper learns the endpoints from the sender a moment later.
            held = self.waiting.setdefault(receiver, [])
            if len(held) < self.hwm:
                held.append(frame)
            else:
                self.undelivered += 1
                self._log_undelivered(receiver)
            return
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.undelivered += 1
            self._log_undelivered(receiver)

    def _log_undelivered(self, receiver: str) -> None:
        if self.undelivered & (self.undelivered - 1) == 0:  # the 1st, 2nd, 4th, 8th...: not one per status
            log.warning("dropped a status for receiver %s: its queue is full (status_hwm %d); "
                        "%d statuses dropped so far", receiver, self.hwm, self.undelivered)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()
        self.sockets.clear()

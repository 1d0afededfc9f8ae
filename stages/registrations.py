"""The sender's receiver registrations: each bound to the key it came under, least
recently heard from first, bounded in all and per key.

Anyone admitted to the bootstrap socket can register, so the registrations are bounded
twice: `max_receivers` in all (the shared table's size), and `max_per_key` under one
CurveZMQ key. A new registration that would pass either bound takes the place of the
registration *of its own key* heard from least recently that owns nothing (no room in
flight, no held alloc: `engaged`), so one key's flood never pushes out another key's
registration, nor frees another key's ids for it to take. Without CURVE every peer is
the one key '', which the per-key bound does not concern.

Every change is written to the shared table (ipc/receivers.py) before anyone hears of
it, so a successor starts from the same registrations.

A status endpoint is where the reaper PUSHes statuses, so it may not be one of the
worker's own sockets (`StatusRule`): a peer that registered `status=<the intake>` would
have the reaper push statuses into intake, which failed those rooms in advance.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from collections import Counter, OrderedDict

from ipc.receivers import MAX_RECEIVERS, ReceiverTable
from ipc.wire import TOKENSPEED_STATUS, Register


def _may_be_this_host(host: str) -> bool:
    """Whether a connect to `host` may reach this host: a name may (only a lookup would
    tell, and the name's owner chooses its answer), as may loopback, the unspecified
    address and any address this host can bind."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return True
    if ip.is_loopback or ip.is_unspecified:
        return True
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(ip), 0))  # succeeds only for an address of this host
        except OSError:
            return False
    return True


class StatusRule:
    """Which status endpoints a registration may name: none of the worker's own sockets
    (`own`: its listeners' endpoints, 'tcp://H:P', 'H:P' or 'ipc://PATH'), and an
    ipc:// path only inside one of `ipc_dirs`."""

    def __init__(self, own: list[str], ipc_dirs: list[str]):
        self.own_ports: set[int] = set()
        self.own_paths: set[str] = set()
        for endpoint in own:
            if endpoint.startswith("ipc://"):
                self.own_paths.add(os.path.realpath(endpoint[len("ipc://"):]))
            elif endpoint:
                port = endpoint.rsplit(":", 1)[-1]
                if port.isdigit() and int(port):
                    self.own_ports.add(int(port))
        self.ipc_dirs = [os.path.realpath(d) for d in ipc_dirs if d]

    def problem(self, status: str) -> str | None:
        """Why a registration may not name `status`, or None."""
        endpoint = status.removeprefix(TOKENSPEED_STATUS)
        if endpoint.startswith("ipc://"):
            path = os.path.realpath(endpoint[len("ipc://"):])
            if path in self.own_paths:
                return f"register: status {status!r} is one of the worker's own sockets"
            if not any(os.path.commonpath([path, d]) == d for d in self.ipc_dirs):
                return (f"register: status {status!r} is an ipc:// path outside status_ipc_dirs "
                        f"(the directories receivers' ipc:// status sockets may be in)")
            return None
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if int(port) in self.own_ports and _may_be_this_host(host):
            return f"register: status {status!r} may be one of the worker's own sockets (port {port})"
        return None


class Registrations:
    """receiver id -> its Register, as a read-only mapping, with the sender's rules for
    adding, hearing from and dropping one."""

    def __init__(self, table: ReceiverTable, engaged: Counter, *, idle_s: float,
                 max_per_key: int = MAX_RECEIVERS, status_rule: StatusRule | None = None):
        self.table = table
        self.status_rule = status_rule or StatusRule([], [])
        self.engaged = engaged  # receiver -> its rooms in flight and allocs held (the sender's)
        self.idle_s = idle_s
        self.max_receivers = MAX_RECEIVERS
        self.max_per_key = max_per_key
        self.by_id: OrderedDict[str, Register] = OrderedDict()  # least recently heard from first
        self.by_key: dict[str, OrderedDict[str, None]] = {}  # the same order, per key
        self.heard_at: dict[str, float] = {}
        self.expired = 0
        self.evicted = 0

    def __contains__(self, receiver: str) -> bool:
        return receiver in self.by_id

    def __getitem__(self, receiver: str) -> Register:
        return self.by_id[receiver]

    def __iter__(self):
        return iter(self.by_id)

    def __len__(self) -> int:
        return len(self.by_id)

    def get(self, receiver: str) -> Register | None:
        return self.by_id.get(receiver)

    def load(self, now: float) -> None:
        """A predecessor's registrations, from the shared table (as heard from `now`: how
        recently the predecessor heard from them died with it)."""
        for reg in self.table.registrations().values():
            self._keep(reg, now)

    def add(self, m: Register, now: float) -> str | None:
        """Register `m` (under `m.key`), or say why not."""
        problem = self.status_rule.problem(m.status)
        if problem:
            return problem
        if m.receiver not in self.by_id:
            own = self.by_key.get(m.key, ())
            if len(self.by_id) >= self.max_receivers or (m.key and len(own) >= self.max_per_key):
                idle = next((rx for rx in own if not self.engaged[rx]), None)
                if idle is None:
                    return (f"register: no room for it, and each receiver of its key has a room in flight "
                            f"({len(own)} of its key, max_receivers_per_key {self.max_per_key}; "
                            f"{len(self.by_id)} in all, at most {self.max_receivers})")
                self.remove(idle)
                self.evicted += 1
        # In shared memory before anyone hears of it, so a restarted sender or reaper
        # knows every receiver that may send an alloc or wait for a status.
        self.table.put(m.receiver, m.session, m.status, m.incarnation, m.key)
        self._keep(m, now)
        return None

    def _keep(self, m: Register, now: float) -> None:
        self.by_id[m.receiver] = m
        self.by_key.setdefault(m.key, OrderedDict())[m.receiver] = None
        self.heard(m.receiver, now)

    def heard(self, receiver: str, now: float) -> None:
        self.heard_at[receiver] = now
        self.by_id.move_to_end(receiver)
        self.by_key[self.by_id[receiver].key].move_to_end(receiver)

    def remove(self, receiver: str) -> None:
        """Out of the shared table first: a successor must not bring it back."""
        self.table.remove(receiver)
        key = self.by_id.pop(receiver).key
        own = self.by_key[key]
        del own[receiver]
        if not own:
            del self.by_key[key]
        self.heard_at.pop(receiver, None)
        self.engaged.pop(receiver, None)

    def expire(self, now: float) -> None:
        """Least recently heard from first: those idle past idle_s that own nothing
        expire; one that still owns a room is passed over (as heard from now: its room
        will end, and its idle time with it)."""
        limit = now - self.idle_s
        while self.by_id:
            receiver = next(iter(self.by_id))
            if self.heard_at[receiver] >= limit:
                return
            if self.engaged[receiver]:
                self.heard(receiver, now)
                continue
            self.remove(receiver)
            self.expired += 1

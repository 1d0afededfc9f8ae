"""The kernel's TCP socket table, read for the bytes a dead process's connections still carry.

A process SIGKILLed does not take its TCP connections' queued bytes along: the kernel
keeps each socket as an orphan (no file, inode 0 in /proc/net/tcp), goes on sending
what was queued, then the FIN. A Mooncake write cut short by its sender's death thus
still lands, in part, at the receiver, after the sender is gone. `orphaned` lists what
can still land: every orphan's unacknowledged bytes (tx_queue), and what a peer socket
on this host holds unread from an orphan (its rx_queue; a remote peer's is out of
sight: once acknowledged, the bytes are in its kernel, read in the peer's next moments
unless the peer itself is stalled); `destination` says which of them go to a receiver.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from typing import NamedTuple

__all__ = ["Destination", "TcpSocket", "destination", "host_addresses", "orphaned", "port_groups", "read_table"]

# States (include/net/tcp_states.h) in which an orphan may still send or be read from.
_ESTABLISHED, _FIN_WAIT1, _FIN_WAIT2, _CLOSE_WAIT, _LAST_ACK, _LISTEN, _CLOSING = 1, 4, 5, 8, 9, 10, 11
_CARRYING = frozenset({_ESTABLISHED, _FIN_WAIT1, _FIN_WAIT2, _CLOSE_WAIT, _LAST_ACK, _CLOSING})
_FIN_SENT = frozenset({_FIN_WAIT1, _LAST_ACK, _CLOSING})
_FIN_HEARD = frozenset({_CLOSE_WAIT, _LAST_ACK, _CLOSING})


class TcpSocket(NamedTuple):
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    tx_queue: int
    rx_queue: int
    inode: int


def _address(field: str) -> tuple[str, int]:
    host, port = field.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host order (little-endian here).
    raw = b"".join(struct.pack("<I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def read_table(net_dir: str = "/proc/net") -> list[TcpSocket]:
    """Every TCP socket of this network namespace, IPv4 and IPv6."""
    out = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{net_dir}/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:  # no IPv6 in this kernel, or no /proc
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            tx, rx = cols[4].split(":")
            out.append(
                TcpSocket(
                    _address(cols[1]), _address(cols[2]), int(cols[3], 16), int(tx, 16), int(rx, 16), int(cols[9])
                )
            )
    return out


def orphaned(table: list[TcpSocket]) -> list[tuple[tuple[str, int], int]]:
    """(remote address, bytes it can still deliver there) of every orphaned connection that
    carries any: unacknowledged at the orphan, or unread at a peer socket on this host."""
    # A FIN received counts one in rx_queue, as one sent does in tx_queue: neither is a byte.
    unread = {(s.local, s.remote): max(0, s.rx_queue - (s.state in _FIN_HEARD)) for s in table if s.inode}
    out = []
    for s in table:
        if not s.inode and s.state in _CARRYING:
            n = max(0, s.tx_queue - (s.state in _FIN_SENT)) + unread.get((s.remote, s.local), 0)
            if n:
                out.append((s.remote, n))
    return out


class Destination(NamedTuple):
    """Where a receiver's bytes go: its addresses (None: any) and ports (None: any)."""

    addresses: frozenset[str] | None
    ports: frozenset[int] | None

    def carried(self, orphans) -> int:
        """Bytes `orphans` (orphaned()) can still deliver here."""
        return sum(
            n
            for (ip, port), n in orphans
            if (self.addresses is None or ip in self.addresses) and (self.ports is None or port in self.ports)
        )


def port_groups(table: list[TcpSocket], proc: str = "/proc") -> dict[int, frozenset[int]]:
    """Listening port -> every port its process listens on, for the processes this one may
    look into (through /proc: one pass over every process's descriptors)."""
    listening = {s.inode: s.local[1] for s in table if s.state == _LISTEN and s.inode}
    groups: dict[int, frozenset[int]] = {}
    for pid in filter(str.isdigit, _listdir(proc)):
        ports = set()
        for fd in _listdir(f"{proc}/{pid}/fd"):
            try:
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in listening:
                ports.add(listening[int(target[8:-1])])
        for port in ports:
            groups[port] = frozenset(ports)
    return groups


def destination(session: str, table: list[TcpSocket], groups: dict[int, frozenset[int]]) -> Destination:
    """Where bytes for the Mooncake session `session` ("host:rpc_port") go. Its data port is
    not in the session: for a receiver on this host it is another port its process listens
    on (`groups`: port_groups()); for one elsewhere, or a process this one may not look
    into, any port of its address counts."""
    host, _, port = session.rpartition(":")
    addresses = host_addresses([host])
    local = addresses is not None and bool(addresses & ({"127.0.0.1", "::1"} | {s.local[0] for s in table}))
    ports = groups.get(int(port)) if local and port.isdigit() else None
    return Destination(addresses, ports)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # gone meanwhile, or not ours to read
        return []


def host_addresses(hosts) -> frozenset[str] | None:
    """The IP addresses of `hosts` (Mooncake sessions' hosts), or None (any) when one of
    them is a name: it is not resolved here (the caller's loop must not wait on DNS)."""
    out = set()
    for host in hosts:
        try:
            out.add(str(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            return None
    if out & {"127.0.0.1", "::1"}:
        out |= {"127.0.0.1", "::1"}
    return frozenset(out)

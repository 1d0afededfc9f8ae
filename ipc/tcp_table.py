"""The kernel's TCP socket table, read for the bytes a dead process's connections still carry.

A process SIGKILLed does not take its TCP connections' queued bytes along: the kernel
keeps each socket as an orphan (no file, inode 0 in /proc/net/tcp), goes on sending
what was queued, then the FIN. A Mooncake write cut short by its sender's death thus
still lands, in part, at the receiver, after the sender is gone. `late_bytes` counts
what can still land: every orphan's unacknowledged bytes (tx_queue), and what a peer
socket on this host holds unread from an orphan (its rx_queue; a remote peer's is out
of sight: once acknowledged, the bytes are in its kernel, read in the peer's next
moments unless the peer itself is stalled).
"""
from __future__ import annotations

import ipaddress
import struct
from typing import NamedTuple

__all__ = ["TcpSocket", "host_addresses", "late_bytes", "read_table"]

# States (include/net/tcp_states.h) in which an orphan may still send or be read from.
_ESTABLISHED, _FIN_WAIT1, _FIN_WAIT2, _CLOSE_WAIT, _LAST_ACK, _CLOSING = 1, 4, 5, 8, 9, 11
_CARRYING = frozenset({_ESTABLISHED, _FIN_WAIT1, _FIN_WAIT2, _CLOSE_WAIT, _LAST_ACK, _CLOSING})


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
            out.append(TcpSocket(_address(cols[1]), _address(cols[2]), int(cols[3], 16),
                                 int(tx, 16), int(rx, 16), int(cols[9])))
    return out


def late_bytes(hosts: set[str] | None = None, net_dir: str = "/proc/net") -> int:
    """Bytes orphaned connections to `hosts` (IP addresses as str; None: any) can still
    deliver: unacknowledged at the orphan, or unread at a peer socket on this host."""
    table = read_table(net_dir)
    unread = {(s.local, s.remote): s.rx_queue for s in table if s.inode}
    total = 0
    for s in table:
        if s.inode or s.state not in _CARRYING or (hosts is not None and s.remote[0] not in hosts):
            continue
        total += s.tx_queue + unread.get((s.remote, s.local), 0)
    return total


def host_addresses(hosts) -> set[str] | None:
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
    return out

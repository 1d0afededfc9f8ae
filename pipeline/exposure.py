"""Which endpoints a peer off this host can reach, and the rule for unauthenticated ones.

A socket without CurveZMQ authentication (or a front whose wire has none, as
tokenspeed's) is bound only to loopback or ipc:// unless the operator says
`allow_insecure_network`: anyone who reaches it may send encodes, register under any
receiver id and cancel any room.
"""
from __future__ import annotations

import ipaddress

INSECURE_FLAG = "--allow-insecure-network"


def endpoint_host(endpoint: str) -> str | None:
    """The host an endpoint binds to: 'tcp://H:P', 'http://H:P', or plain 'H:P';
    None for ipc:// and inproc:// (no network)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    rest = endpoint.split("://", 1)[1] if "://" in endpoint else endpoint
    rest = rest.split("/", 1)[0]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', a name, an interface: may be reached from off the host


def exposure_problem(endpoint: str, key: str, authenticated: bool, allow_insecure: bool) -> str | None:
    """Why `endpoint` (the setting `key`) may not be bound as configured, or None."""
    host = endpoint_host(endpoint)
    if host is None or authenticated or allow_insecure or is_loopback_host(host):
        return None
    return (f"{key} {endpoint!r} is not loopback or ipc://, and nothing authenticates its peers: anyone "
            f"who reaches it could send encodes, register as any receiver and cancel any room. Set "
            f"curve_cert and curve_clients (CurveZMQ), bind it to 127.0.0.1, or accept the risk with "
            f"{INSECURE_FLAG} (a private network or a firewall that admits only your peers)")

"""Which endpoints a peer off this host can reach, the rule for unauthenticated ones, and
the bounds of every HTTP listener.

One rule for every listener: a socket without CurveZMQ authentication (a front whose
wire has none, as tokenspeed's, and the metrics endpoint) is bound only to loopback or
ipc:// unless the operator says `allow_insecure_network`: anyone who reaches intake or
bootstrap may send encodes, register under any receiver id and cancel any room, and
anyone who reaches any listener may hold its connections open.
"""
from __future__ import annotations

import ipaddress
import logging
import threading

log = logging.getLogger("epd.listeners")

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


PROTOCOL_RISK = "send encodes, register as any receiver and cancel any room"
REMEDY_CURVE = "set curve_cert and curve_clients (CurveZMQ), "


def exposure_problem(endpoint: str, key: str, authenticated: bool, allow_insecure: bool,
                     risk: str = PROTOCOL_RISK, remedy: str = REMEDY_CURVE) -> str | None:
    """Why `endpoint` (the setting `key`) may not be bound as configured, or None."""
    host = endpoint_host(endpoint)
    if host is None or authenticated or allow_insecure or is_loopback_host(host):
        return None
    fix = f"{remedy}bind it to 127.0.0.1"
    return (f"{key} {endpoint!r} is not loopback or ipc://, and nothing authenticates its peers: anyone "
            f"who reaches it could {risk}. {fix[0].upper()}{fix[1:]}, or accept the risk "
            f"with {INSECURE_FLAG} (a private network or a firewall that admits only your peers)")


# ------------------------------------------------------------------ every HTTP listener's bounds

MAX_HTTP_CONNECTIONS = 16  # connections an HTTP listener serves at once; more are closed as they come
HTTP_IDLE_TIMEOUT_S = 5.0  # a client that sends nothing for this long is dropped


class BoundedHTTP:
    """A mixin for a socketserver TCP server (put it first): at most MAX_HTTP_CONNECTIONS
    connections, each in a thread of its own, and each dropped once it sends nothing for
    HTTP_IDLE_TIMEOUT_S (the handler's `timeout`). Connections past the cap are closed,
    not queued: each one held is a descriptor and a thread, and a worker out of
    descriptors fails rooms."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 64  # a burst is accepted and turned away rather than left to time out

    def __init__(self, *args, **kwargs):
        self.slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        """A client that timed out or went away is dropped quietly (socketserver would
        print a traceback to stderr for each)."""
        import sys

        if isinstance(sys.exc_info()[1], OSError):
            log.debug("http client %s dropped: %r", client_address, sys.exc_info()[1])
        else:
            log.warning("http request from %s failed", client_address, exc_info=True)

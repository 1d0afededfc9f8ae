"""CurveZMQ for the worker's sockets and for the libraries beside it.

Certificates are pyzmq's files (`zmq.auth.create_certificates`): a `.key_secret` file
holds a key pair, a `.key` file its public half. A socket that binds is the CURVE
server and admits only the public keys it is given; a ZAP handler in its ZeroMQ
context checks each peer as it connects, and every frame from an admitted peer carries
that peer's public key (Z85) as its "User-Id" property. A socket that connects is a
CURVE client and must know the server's public key.

Several sockets of one context may admit different keys: each gets a ZAP domain of
its own, and the context's one handler answers for all of them.
"""
from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes


def load_keypair(path: str) -> KeyPair:
    """The key pair in a `.key_secret` certificate file; ValueError if it holds none."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CurveZMQ certificate {path!r}: {e}") from None
    if not secret:
        raise ValueError(f"{path!r} holds no secret key: give the .key_secret file of zmq.auth.create_certificates")
    return KeyPair(public, secret)


def load_public(path: str) -> bytes:
    """The public key (Z85) in a certificate file, `.key` or `.key_secret`."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the CurveZMQ certificate {path!r}: {e}") from None
    return public


def load_allowed(directory: str) -> frozenset[bytes]:
    """The public keys of the certificates in `directory`; ValueError if there are none."""
    if not os.path.isdir(directory):
        raise ValueError(f"{directory!r} is not a directory of public CurveZMQ certificates")
    keys = frozenset(zmq.auth.load_certificates(directory))
    if not keys:
        raise ValueError(f"{directory!r} holds no public CurveZMQ certificate (*.key): nobody could connect")
    return keys


@dataclass(frozen=True)
class ServerKeys:
    """What a CURVE server needs: its own key pair and the public keys it admits."""
    own: KeyPair
    allowed: frozenset[bytes]

    @classmethod
    def load(cls, cert: str, clients: str) -> "ServerKeys":
        return cls(load_keypair(cert), load_allowed(clients))


def peer_keys(curve_cert: str | None, worker_cert: str | None) -> tuple[KeyPair, bytes] | None:
    """For a gateway or a receiver: its own key pair (`curve_cert`, a `.key_secret` file)
    and the worker's public key (`worker_cert`); None when neither is given."""
    if not curve_cert and not worker_cert:
        return None
    if not (curve_cert and worker_cert):
        raise ValueError("curve_cert and worker_cert go together: set both for CurveZMQ, or neither")
    return load_keypair(curve_cert), load_public(worker_cert)


class _Admit:
    """ZAP credentials for one domain: only these keys."""

    def __init__(self, allowed: frozenset[bytes]):
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


_lock = threading.Lock()
_authenticators: dict[int, tuple[zmq.Context, ThreadAuthenticator]] = {}
_domains = itertools.count()


def serve(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make `sock` (before it binds) a CURVE server that admits only `keys.allowed`."""
    with _lock:
        got = _authenticators.get(id(sock.context))
        if got is None:
            auth = ThreadAuthenticator(sock.context)
            auth.start()
            _authenticators[id(sock.context)] = (sock.context, auth)
        else:
            auth = got[1]
        domain = f"epd-{os.getpid()}-{next(_domains)}"
        auth.configure_curve_callback(domain, _Admit(keys.allowed))
    sock.zap_domain = domain.encode()
    sock.curve_secretkey = keys.own.secret
    sock.curve_publickey = keys.own.public
    sock.curve_server = True


def connect_as(sock: zmq.Socket, own: KeyPair, server_public: bytes) -> None:
    """Make `sock` (before it connects) a CURVE client of the server with `server_public`."""
    sock.curve_secretkey = own.secret
    sock.curve_publickey = own.public
    sock.curve_serverkey = server_public


def stop(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of `ctx`, if it has one: before `ctx.term()`, which waits for it."""
    with _lock:
        got = _authenticators.pop(id(ctx), None)
    if got is not None:
        got[1].stop()


def peer_key(frame: zmq.Frame) -> str:
    """The public key (Z85) the peer that sent `frame` authenticated with."""
    return frame.get("User-Id")

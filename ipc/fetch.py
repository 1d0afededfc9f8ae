"""A compressed image fetched from an http(s) URL the operator allowed (protocol 1.2).

The URL is the peer's to choose, so the rules here stand against a request forgery
(SSRF): only the hosts of the operator's allow-list; each of the host's addresses must
be global (not private, loopback, link-local, multicast or reserved) unless the
allow-list names that address or its network; the connection goes to the address that
was checked (a second resolution could answer otherwise: DNS rebinding), with Host and
SNI of the name; no redirect is followed; the body is capped, asked for without
compression, and the whole fetch (resolve, connect, headers, body) has one deadline.

Stdlib only (http.client, ssl, socket): no proxy from the environment is used.
"""

from __future__ import annotations

import http.client
import ipaddress
import re
import socket
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_URL = 2048  # characters of a media.url; longer ones are refused at intake
DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# What an image file of each format begins with: a body that is not one (an error page
# served as 200) is refused naming what it is, not handed to a decoder.
_MAGIC = {"jpeg": (b"\xff\xd8\xff",), "png": (b"\x89PNG\r\n\x1a\n",), "webp": (b"RIFF",)}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class FetchError(Exception):
    """Why a URL's image was not fetched: a sentence for the person who sent it."""


@dataclass(frozen=True)
class Url:
    scheme: str
    host: str  # a lowercased name, or an IP address (an IPv6 one without brackets)
    port: int
    target: str  # the path and query, as sent on the request line

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == DEFAULT_PORTS[self.scheme] else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.target}"


def _address(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _check_host(host: str) -> None:
    """A DNS name of letters, digits and hyphens, or an IP address. A name whose last label
    is not alphabetic-led is refused: resolvers read '2130706433' or '0x7f.1' as addresses."""
    if _address(host) is not None:
        if "%" in host:
            raise ValueError("an IPv6 zone is not allowed in a URL's host")
        return
    labels = host.split(".")
    if len(host) > 253 or not all(_LABEL.fullmatch(label) for label in labels) or not labels[-1][0].isalpha():
        raise ValueError(f"{host!r} is not a host name (letters, digits, hyphens and dots) or an IP address")


def parse_url(url) -> Url:
    """An http(s) URL, parsed strictly; ValueError says what is wrong with it."""
    if not isinstance(url, str) or not 1 <= len(url) <= MAX_URL:
        raise ValueError(f"a URL is a string of 1..{MAX_URL} characters")
    if not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
        raise ValueError("a URL has no spaces, control characters or non-ASCII characters (percent-encode them)")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError("the URL's scheme must be http or https")
    if "@" in parts.netloc:
        raise ValueError("a URL with a user name or password (user@host) is not fetched")
    try:
        port = parts.port or DEFAULT_PORTS[scheme]
    except ValueError:
        raise ValueError("the URL's port must be a number in 1..65535") from None
    host = (parts.hostname or "").lower()
    if not host:
        raise ValueError("the URL has no host")
    _check_host(host)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Url(scheme, host, port, target)


class AllowList:
    """The operator's hosts (media_url_hosts): names matched exactly, and IP addresses or
    networks, which allow both a URL naming them and a name that resolves into them."""

    def __init__(self, text: str = ""):
        self.names: frozenset[str] = frozenset()
        networks: list[IPNetwork] = []
        names = set()
        for entry in (e.strip().lower() for e in text.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            _check_host(entry)
            names.add(entry)
        self.names, self.networks = frozenset(names), tuple(networks)

    def __bool__(self) -> bool:
        return bool(self.names or self.networks)

    def allows_host(self, host: str) -> bool:
        """The intake's check: no resolution, the URL's host against the list as written."""
        ip = _address(host)
        return host in self.names if ip is None else self.allows_address(ip)

    def allows_address(self, ip: IPAddress) -> bool:
        return any(ip in net for net in self.networks)


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        # An IPv6 address that carries an IPv4 one reaches that one (::ffff:127.0.0.1
        # here; 6to4, Teredo and NAT64 through a gateway): it is judged as that one too.
        inner = [ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        if ip in _NAT64:
            inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if any(v4 is not None and not _public(v4) for v4 in inner):
            return False
        if ip.ipv4_mapped is not None:
            return True
    return ip.is_global and not ip.is_multicast and not ip.is_reserved


def resolve(url: Url, allow: AllowList) -> list[str]:
    """The host's addresses, each one global or listed; FetchError if any is not."""
    try:
        infos = socket.getaddrinfo(url.host, url.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise FetchError(f"{url.host} does not resolve ({e.strerror})") from None
    addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for a in addrs:
        ip = ipaddress.ip_address(a.split("%")[0])
        if not (allow.allows_address(ip) or _public(ip)):
            raise FetchError(
                f"{url.host} resolves to {a}, a private, loopback or reserved address; the worker fetches "
                f"from such addresses only where media_url_hosts names them"
            )
    if not addrs:
        raise FetchError(f"{url.host} does not resolve")
    return addrs


class _Pinned(http.client.HTTPConnection):
    """A connection over a socket already connected to the checked address: http.client
    never resolves the name itself, yet sends it as Host."""

    def __init__(self, url: Url, sock: socket.socket):
        super().__init__(url.host, url.port)
        self.default_port = DEFAULT_PORTS[url.scheme]  # Host names the port only where it is not the default
        self._pinned = sock

    def connect(self) -> None:
        self.sock = self._pinned


_context: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    global _context
    if _context is None:
        _context = ssl.create_default_context()  # certificates verified, the host name checked
    return _context


def fetch(url: Url, allow: AllowList, max_bytes: int, deadline: float, context: ssl.SSLContext | None = None) -> bytes:
    """The body of a GET of `url`, at most `max_bytes`, by `deadline` (time.monotonic());
    FetchError says why not."""
    addrs = resolve(url, allow)
    sock = _connect(url, addrs, deadline)
    # A socket timeout bounds each read, not their sum (a server may drip a byte at a
    # time): at the deadline the socket is shut, which ends any read in progress.
    timer = threading.Timer(max(0.0, deadline - time.monotonic()), _shut, (sock,))
    timer.daemon = True
    timer.start()
    try:
        conn_sock = sock
        if url.scheme == "https":
            conn_sock = (context or _tls()).wrap_socket(sock, server_hostname=url.host)
        conn = _Pinned(url, conn_sock)
        conn.putrequest("GET", url.target, skip_accept_encoding=True)
        conn.putheader("Accept-Encoding", "identity")  # the cap counts the bytes the decoder gets
        conn.putheader("Accept", "image/jpeg, image/png, image/webp")
        conn.putheader("User-Agent", "epd-encode-worker")
        conn.putheader("Connection", "close")
        conn.endheaders()
        return _body(url, conn.getresponse(), max_bytes, deadline)
    except (OSError, http.client.HTTPException) as e:
        if time.monotonic() >= deadline:
            raise FetchError("the fetch took longer than media_url_timeout_s") from None
        raise FetchError(f"the fetch failed: {type(e).__name__}: {e}") from None
    finally:
        timer.cancel()
        sock.close()


def _connect(url: Url, addrs: list[str], deadline: float) -> socket.socket:
    error: OSError | None = None
    for a in addrs:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            return socket.create_connection((a, url.port), timeout=left)
        except OSError as e:
            error = e
    if time.monotonic() >= deadline:
        raise FetchError("the fetch took longer than media_url_timeout_s (connecting)")
    raise FetchError(f"cannot connect to {url.host} port {url.port}: {error}")


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _body(url: Url, resp: http.client.HTTPResponse, max_bytes: int, deadline: float) -> bytes:
    if 300 <= resp.status < 400:
        where = (resp.getheader("Location") or "")[:200]
        raise FetchError(
            f"the server answered {resp.status} (a redirect to {where!r}); the worker follows no redirect: "
            f"send the final URL"
        )
    if resp.status != 200:
        raise FetchError(f"the server answered {resp.status} {resp.reason[:100]}")
    encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise FetchError(f"the server sent the image compressed ({encoding[:40]}) though asked for identity")
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        raise FetchError(
            f"the image is {int(length)} bytes; the worker fetches at most {max_bytes} (media_url_max_bytes)"
        )
    chunks, n = [], 0
    while n <= max_bytes:
        chunk = resp.read(min(1 << 16, max_bytes + 1 - n))
        if not chunk:
            break
        chunks.append(chunk)
        n += len(chunk)
        if time.monotonic() >= deadline:
            raise FetchError("the fetch took longer than media_url_timeout_s")
    if n > max_bytes:
        raise FetchError(f"the image is over {max_bytes} bytes (media_url_max_bytes)")
    if n == 0:
        raise FetchError("the server sent no bytes")
    return b"".join(chunks)


def check_format(data: bytes, fmt: str) -> None:
    """FetchError unless `data` begins as a `fmt` file does."""
    magic = _MAGIC.get(fmt)
    if magic is None:  # a format without a check here: its decoder's is the only one
        return
    if not (any(data.startswith(m) for m in magic) and (fmt != "webp" or data[8:12] == b"WEBP")):
        raise FetchError(f"the URL's bytes are not a {fmt} file (they begin {data[:16]!r})")


@dataclass(frozen=True)
class UrlSettings:
    """The operator's rules for URLs (media_url_hosts, media_url_max_bytes, media_url_timeout_s)."""

    hosts: str = ""  # none: the worker fetches no URL
    max_bytes: int = 32 << 20
    timeout_s: float = 10.0


FETCH_THREADS = 4
# The stage gives its threads this long past a fetch's deadline before it fails the
# fetch itself: a fetch ends by its deadline except in a name's resolution, which
# getaddrinfo lets run on.
DEADLINE_GRACE_S = 1.0


class Fetches:
    """Fetches off a stage's loop: a few threads of its process each fetch one URL; the
    stage submits, and collects what finished (`done`) at its ticks. The loop goes on
    answering its rings meanwhile. Threads start at the first URL (after any fork)."""

    def __init__(self, settings: UrlSettings):
        self.settings = settings
        self.allow = AllowList(settings.hosts)
        self._pool: ThreadPoolExecutor | None = None
        self._out: list[tuple[object, float, Future]] = []

    def submit(self, key, url: str, fmt: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="fetch")
        # The budget starts now: a fetch waiting for a thread spends it too.
        deadline = time.monotonic() + self.settings.timeout_s
        args = (url, fmt, self.allow, self.settings.max_bytes, deadline)
        self._out.append((key, deadline, self._pool.submit(fetch_image, *args)))

    def pending(self) -> int:
        return len(self._out)

    def done(self, now: float) -> list[tuple[object, bytes | None, str]]:
        """(key, the image's bytes or None, why not) of each fetch that ended."""
        ended, kept = [], []
        for key, deadline, fut in self._out:
            if fut.done():
                e = fut.exception()
                if e is None:
                    ended.append((key, fut.result(), ""))
                else:
                    reason = str(e) if isinstance(e, FetchError) else f"the fetch failed: {type(e).__name__}: {e}"
                    ended.append((key, None, reason))
            elif now > deadline + DEADLINE_GRACE_S:
                fut.cancel()  # its thread, stuck in a resolution, ends on its own; its answer is dropped
                ended.append((key, None, "the fetch took longer than media_url_timeout_s"))
            else:
                kept.append((key, deadline, fut))
        self._out = kept
        return ended

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def fetch_image(url: str, fmt: str, allow: AllowList, max_bytes: int, deadline: float) -> bytes:
    """The `fmt` image at `url`, by every rule of this module; FetchError says why not."""
    try:
        u = parse_url(url)
    except ValueError as e:
        raise FetchError(str(e)) from None
    if not allow.allows_host(u.host):
        raise FetchError(f"the URL's host {u.host} is not in media_url_hosts")
    data = fetch(u, allow, max_bytes, deadline)
    check_format(data, fmt)
    return data

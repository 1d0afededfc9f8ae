"""ipc/fetch.py: http(s) images fetched only as the operator allows (issue #35).

Against a local HTTP server in a thread: URLs are off by default, a host must be listed,
a loopback address only where its address is listed, no redirect is followed, the size
cap holds against a Content-Length and against a body that has none, a slow server
runs into the time budget, a 404 and a body of the wrong format fail with their reason.
"""

from __future__ import annotations

import http.server
import ipaddress
import threading
import time
from contextlib import contextmanager

import pytest

from ipc import fetch
from ipc.fetch import AllowList, FetchError, Fetches, UrlSettings, fetch_image, parse_url

pytestmark = pytest.mark.timeout(60)
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


def reply(h, status: int, body: bytes = b"", headers: dict | None = None, length: bool = True) -> None:
    h.send_response(status)
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    if length:
        h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def _chunked(h, body: bytes) -> None:
    h.send_response(200)
    h.send_header("Transfer-Encoding", "chunked")
    h.end_headers()
    for i in range(0, len(body), 4096):
        part = body[i : i + 4096]
        h.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
    h.wfile.write(b"0\r\n\r\n")


def default_routes(release: threading.Event) -> dict:
    """What each path of the test server answers; `release` ends the slow ones."""

    def slow(h):
        release.wait(30)  # a server that does not answer within any test's budget
        reply(h, 200, PNG)

    def drip(h):  # headers at once, then a byte at a time: no single read waits long
        h.send_response(200)
        h.send_header("Content-Length", str(len(PNG)))
        h.end_headers()
        for b in PNG:
            if release.wait(0.05):
                return
            h.wfile.write(bytes([b]))
            h.wfile.flush()

    return {
        "/img.png": lambda h: reply(h, 200, PNG),
        "/redirect": lambda h: reply(h, 302, b"", {"Location": "http://169.254.169.254/latest"}),
        "/missing": lambda h: reply(h, 404, b"no such image"),
        "/big": lambda h: reply(h, 200, PNG * 64),
        "/claims-big": lambda h: reply(h, 200, PNG, {"Content-Length": str(1 << 40)}, length=False),
        "/chunked-big": lambda h: _chunked(h, PNG * 64),
        "/unsized-big": lambda h: reply(h, 200, PNG * 64, {"Connection": "close"}, length=False),
        "/html": lambda h: reply(h, 200, b"<html>not an image</html>"),
        "/gzip": lambda h: reply(h, 200, PNG, {"Content-Encoding": "gzip"}),
        "/slow": slow,
        "/drip": drip,
    }


@contextmanager
def http_server(routes: dict, tls=None):
    """A server on 127.0.0.1 in a thread (https with `tls`, a server SSLContext); yields
    it. `routes`: path -> fn(handler)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        seen: list = []

        def do_GET(self):
            Handler.seen.append((self.path, dict(self.headers)))
            route = routes.get(self.path.split("?")[0])
            if route is None:
                reply(self, 404)
            else:
                route(self)
            self.close_connection = True

        def log_message(self, *args):
            pass

    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client that stops reading at its cap breaks the pipe: what the tests want

    server = Server(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    server.seen = Handler.seen  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def server():
    release = threading.Event()
    with http_server(default_routes(release)) as s:
        yield s
        release.set()


def get(server, path: str, hosts: str = "127.0.0.1", fmt: str = "png", max_bytes: int = 1 << 20,
        timeout_s: float = 10.0, host: str = "127.0.0.1") -> bytes:
    url = f"http://{host}:{server.server_address[1]}{path}"
    return fetch_image(url, fmt, AllowList(hosts), max_bytes, time.monotonic() + timeout_s)


def refused(server, path: str, **kw) -> str:
    with pytest.raises(FetchError) as e:
        get(server, path, **kw)
    return str(e.value)


def test_a_listed_address_is_fetched_with_host_and_identity_encoding(server):
    assert get(server, "/img.png?x=1") == PNG
    path, headers = server.seen[-1]
    assert path == "/img.png?x=1"
    assert headers["Host"] == f"127.0.0.1:{server.server_address[1]}"
    assert headers["Accept-Encoding"] == "identity"


def test_urls_are_off_by_default_and_a_host_must_be_listed(server):
    assert not AllowList("") and not AllowList(" , ")
    assert "not in media_url_hosts" in refused(server, "/img.png", hosts="")
    assert "not in media_url_hosts" in refused(server, "/img.png", hosts="example.com,10.0.0.0/8")
    f = Fetches(UrlSettings())
    f.submit("k", f"http://127.0.0.1:{server.server_address[1]}/img.png", "png")
    ended = _wait(f)
    assert ended[0][0] == "k" and ended[0][1] is None and "not in media_url_hosts" in ended[0][2]
    f.close()
    assert not server.seen, "nothing was asked of the server"


def test_loopback_is_refused_unless_its_address_is_listed(server):
    # The name is listed but resolves to loopback: refused, naming the address.
    reason = refused(server, "/img.png", hosts="localhost", host="localhost")
    assert "resolves to 127.0.0.1" in reason and "media_url_hosts" in reason
    assert get(server, "/img.png", hosts="localhost, 127.0.0.0/8", host="localhost") == PNG
    assert get(server, "/img.png", hosts="127.0.0.1") == PNG


def test_no_redirect_is_followed(server):
    reason = refused(server, "/redirect")
    assert "302" in reason and "http://169.254.169.254/latest" in reason and "no redirect" in reason
    assert [p for p, _ in server.seen] == ["/redirect"]


@pytest.mark.parametrize("path", ["/big", "/claims-big", "/chunked-big", "/unsized-big"])
def test_the_size_cap_holds_whatever_the_server_says(server, path):
    reason = refused(server, path, max_bytes=len(PNG) * 2)
    assert "media_url_max_bytes" in reason, reason


def test_a_slow_server_runs_into_the_time_budget(server):
    for path in ("/slow", "/drip"):
        assert "longer than media_url_timeout_s" in refused(server, path, timeout_s=0.3), path


def test_a_stalled_fetch_is_failed_by_the_stage_and_others_are_collected(server):
    """Fetches: the stage's view. A fetch past its deadline ends (by its own timer, or
    the stage's grace), and others submitted with it are collected as they end."""
    port = server.server_address[1]
    f = Fetches(UrlSettings(hosts="127.0.0.1", timeout_s=0.3))
    f.submit("slow", f"http://127.0.0.1:{port}/slow", "png")
    f.submit("good", f"http://127.0.0.1:{port}/img.png", "png")
    ended = {}
    while len(ended) < 2:
        ended.update({k: (data, why) for k, data, why in _wait(f)})
    assert ended["good"] == (PNG, "")
    assert ended["slow"][0] is None and "media_url_timeout_s" in ended["slow"][1]
    f.close()


def test_errors_and_wrong_bytes_say_what_they_are(server):
    assert "answered 404" in refused(server, "/missing")
    assert "not a png file" in refused(server, "/html")
    assert "not a jpeg file" in refused(server, "/img.png", fmt="jpeg")
    assert "compressed (gzip)" in refused(server, "/gzip")
    port = server.server_address[1]
    server.server_close()  # nothing listens there now
    with pytest.raises(FetchError, match="cannot connect|failed"):
        fetch_image(f"http://127.0.0.1:{port}/img.png", "png", AllowList("127.0.0.1"), 1 << 20,
                    time.monotonic() + 5)


@pytest.mark.parametrize("url, why", [
    ("ftp://example.com/a.png", "scheme"),
    ("http://user:pw@example.com/a.png", "user name"),
    ("http://example.com@127.0.0.1/a.png", "user name"),
    ("http:///a.png", "no host"),
    ("http://example.com:99999/a.png", "port"),
    ("http://2130706433/a.png", "not a host name"),
    ("http://0x7f.1/a.png", "not a host name"),
    ("http://exa mple.com/a.png", "spaces"),
    ("http://example.com/a.png\r\nX: y", "control"),
    ("http://ex_ample.com/", "not a host name"),
    ("http://" + "a" * 3000 + ".com/", "1..2048"),
])
def test_urls_are_parsed_strictly(url, why):
    with pytest.raises(ValueError, match=why):
        parse_url(url)


def test_parsed_urls_keep_what_is_sent():
    u = parse_url("HTTPS://Example.COM/a/b.png?x=1#frag")
    assert (u.scheme, u.host, u.port, u.target) == ("https", "example.com", 443, "/a/b.png?x=1")
    assert parse_url("http://[::1]:8080").target == "/"
    assert str(parse_url("http://[::1]:8080/x")) == "http://[::1]:8080/x"


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("::1", False), ("::ffff:127.0.0.1", False), ("fe80::1", False), ("fc00::1", False), ("240.0.0.1", False),
    ("::ffff:8.8.8.8", True), ("2002:7f00:1::1", False), ("2002:0808:0808::1", True), ("64:ff9b::a00:1", False),
    ("2001:0:4136:e378:8000:63bf:f5ff:fffe", False),  # Teredo, its client 10.0.0.1
])
def test_only_global_addresses_pass_unlisted(address, public):
    assert fetch._public(ipaddress.ip_address(address)) is public


def test_the_allow_list_checks_hosts_without_resolving():
    allow = AllowList("Images.Example.com, 10.0.0.0/8, ::1")
    assert allow.allows_host("images.example.com") and not allow.allows_host("example.com")
    assert allow.allows_host("10.2.3.4") and allow.allows_host("::1") and not allow.allows_host("11.0.0.1")
    with pytest.raises(ValueError):
        AllowList("http://example.com")


def _wait(f: Fetches, timeout: float = 20.0) -> list:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ended = f.done(time.monotonic())
        if ended:
            return ended
        time.sleep(0.01)
    raise AssertionError("no fetch ended")


def test_the_wire_takes_an_http_url_with_its_format_and_the_client_sends_one():
    from ipc import wire
    from pipeline.peers.client import Client, url_item

    def parse(media: dict):
        msg = {"v": wire.VERSION, "type": "encode", "request_id": "r", "room": 1,
               "items": [{"modality": "image", "grid_thw": [[1, 4, 4]], "media": media}]}
        return wire.parse_encode(msg, 4).items[0].pixels

    px = parse({"url": "HTTPS://Images.Example.com/a.png#x", "format": "png", "max_pixels": 4096})
    assert px.media.url == "https://images.example.com/a.png" and px.media.size == 0 and px.nbytes == 0
    assert (px.data, px.shm, px.media.format, px.media.max_pixels) == (None, None, "png", 4096)
    with pytest.raises(wire.ProtocolError, match="needs media.format"):
        parse({"url": "http://example.com/a.png"})
    with pytest.raises(wire.ProtocolError, match="user name or password"):
        parse({"url": "http://a@example.com/a.png", "format": "png"})
    client = Client.__new__(Client)  # message() alone: no socket
    client.shm_prefix = None
    msg = client.message(1, "r", [url_item("http://example.com/a.png", "jpeg", [1, 4, 4], max_pixels=4096)])
    assert msg["items"][0]["media"] == {"format": "jpeg", "max_pixels": 4096, "url": "http://example.com/a.png"}
    assert wire.parse_encode(msg, 4).items[0].pixels.media.url == "http://example.com/a.png"


def test_https_verifies_the_certificate_against_the_name_sent_as_sni(tmp_path):
    """The connection is pinned to the checked address, yet TLS sees the URL's name:
    SNI and the certificate's check are the name's, and verification is on."""
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    names: list = []
    server_ctx.sni_callback = lambda sock, name, ctx: names.append(name)
    trusting = ssl.create_default_context(cafile=str(cert))
    with http_server({"/img.png": lambda h: reply(h, 200, PNG)}, tls=server_ctx) as server:
        port = server.server_address[1]
        allow = AllowList("localhost, 127.0.0.0/8, ::1")
        url = parse_url(f"https://localhost:{port}/img.png")
        assert fetch.fetch(url, allow, 1 << 20, time.monotonic() + 10, context=trusting) == PNG
        assert names == ["localhost"] and server.seen[-1][1]["Host"] == f"localhost:{port}"
        with pytest.raises(FetchError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            fetch.fetch(url, allow, 1 << 20, time.monotonic() + 10)  # the system's authorities: not ours
        with pytest.raises(FetchError, match="match|mismatch"):  # the certificate names localhost only
            fetch.fetch(parse_url(f"https://127.0.0.1:{port}/img.png"), allow, 1 << 20, time.monotonic() + 10,
                        context=trusting)

"""Fetching image URLs (worker/image_fetch.py) against real servers on loopback: every address that is
not public is refused before anything connects, after every redirect too, and the connection goes
to the address that was checked (a name that resolves elsewhere the second time cannot move it);
tarpits fail by the deadline; FIFOs in MLXQ_IMAGE_DIR are refused, never waited on.

Loopback is exactly what fetches must not reach, so the allowed server is reached through the
documented seam, MLXQ_IMAGE_FETCH_ALLOW_NETS (`AddressPolicy.parse`), with 127.0.0.1/32 only; the
servers that must never be reached listen on [::1] and on 127.0.0.1 when nothing is allowed."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.pictures import encoded
from worker.image_fetch import AddressPolicy, FetchRefused, fetch
from worker.images import ImageError, ImagePolicy, image_bytes

PNG = encoded("PNG", (30, 20))
LOOPBACK_ONLY = AddressPolicy.parse(["127.0.0.1/32"])


class Recorder(BaseHTTPRequestHandler):
    """Serves /ok.png, redirects /to?<url>, tarpits /silent and /drip; records every request."""

    hits: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).hits.append((self.path, self.headers.get("Host", "")))
        route = self.path.split("?", 1)[0]
        if route == "/ok.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path.startswith("/to?"):
            self.send_response(302)
            self.send_header("Location", self.path[4:])
            self.end_headers()
        elif route == "/silent":
            time.sleep(8)
        elif route == "/drip":
            self.send_response(200)
            self.end_headers()
            for _ in range(80):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        return None


class IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def serve(handler: type, host: str) -> tuple[ThreadingHTTPServer, int]:
    httpd = (IPv6Server if ":" in host else ThreadingHTTPServer)((host, 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, httpd.server_address[1]


@pytest.fixture
def servers() -> Iterator[tuple[int, int, type, type]]:
    """An image server on 127.0.0.1 and an 'internal' one on [::1], each recording its requests."""
    allowed = type("Allowed", (Recorder,), {"hits": []})
    internal = type("Internal", (Recorder,), {"hits": []})
    outside, outside_port = serve(allowed, "127.0.0.1")
    inside, inside_port = serve(internal, "::1")
    yield outside_port, inside_port, allowed, internal
    for httpd in (outside, inside):
        httpd.shutdown()
        httpd.server_close()


def get(url: str, policy: AddressPolicy = AddressPolicy(), timeout_s: float = 5.0, **kwargs: object) -> bytes:
    return fetch(url, max_bytes=100_000, timeout_s=timeout_s, max_redirects=3, policy=policy, **kwargs)  # type: ignore[arg-type]


def test_only_public_addresses_are_allowed():
    policy = AddressPolicy()
    for public in ("8.8.8.8", "1.1.1.1", "2001:4860:4860::8888", "2606:4700:4700::1111"):
        assert policy.allowed(ipaddress.ip_address(public)), public
    for private in ("127.0.0.1", "127.9.9.9", "0.0.0.0", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                    "100.64.0.1", "224.0.0.1", "240.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1",
                    "ff02::1", "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2002:7f00:1::", "2002:a00:1::",
                    "2001:0:4136:e378:8000:63bf:80ff:fffe"):
        assert not policy.allowed(ipaddress.ip_address(private)), private
    assert LOOPBACK_ONLY.allowed(ipaddress.ip_address("127.0.0.1"))
    assert not LOOPBACK_ONLY.allowed(ipaddress.ip_address("127.0.0.2"))
    with pytest.raises(ValueError):
        AddressPolicy.parse(["not-a-net"])


def test_non_public_addresses_are_refused_before_anything_connects(servers):
    port, inside_port, allowed, internal = servers
    for url in (f"http://127.0.0.1:{port}/ok.png", f"http://localhost:{port}/ok.png",
                f"http://2130706433:{port}/ok.png", f"http://0x7f000001:{port}/ok.png",
                f"http://[::ffff:127.0.0.1]:{port}/ok.png", f"http://[::1]:{inside_port}/ok.png",
                f"http://0.0.0.0:{port}/ok.png", "http://169.254.169.254/latest/meta-data/",
                "http://10.0.0.1/a.png", "http://[fe80::1]/a.png", "http://[2002:7f00:1::]/a.png"):
        with pytest.raises(FetchRefused, match="not a public address|cannot resolve"):
            get(url)
    assert allowed.hits == [] and internal.hits == []
    assert get(f"http://127.0.0.1:{port}/ok.png", LOOPBACK_ONLY) == PNG  # the seam lets the test server in


def test_redirects_are_checked_hop_by_hop(servers):
    port, inside_port, allowed, internal = servers
    base = f"http://127.0.0.1:{port}"
    assert get(f"{base}/to?/to?/ok.png", LOOPBACK_ONLY) == PNG
    for target, needle in ((f"http://[::1]:{inside_port}/ok.png", "not a public address"),
                           ("http://[::ffff:127.0.0.2]/", "not a public address"),
                           ("http://169.254.169.254/latest/meta-data/", "not a public address"),
                           ("http://127.0.0.2/", "not a public address"),
                           ("file:///etc/passwd", "not an http"), ("gopher://127.0.0.1:6379/_FLUSHALL", "not an http")):
        with pytest.raises(FetchRefused, match=needle):
            get(f"{base}/to?{target}", LOOPBACK_ONLY)
    assert internal.hits == []
    with pytest.raises(FetchRefused, match="more than 3 redirects"):
        get(f"{base}/to?/to?/to?/to?/ok.png", LOOPBACK_ONLY)


def test_the_connection_goes_to_the_address_that_was_checked(servers):
    """DNS rebinding: the name resolves to the allowed address for the check and to an internal
    one a moment later; the fetch resolves once per hop and connects to what it checked."""
    port, inside_port, allowed, internal = servers
    answers = iter([["127.0.0.1"], ["::1"], ["::1"]])
    calls: list[str] = []

    def rebinding(host: str, _port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    assert get(f"http://images.example:{port}/ok.png", LOOPBACK_ONLY, resolve=rebinding) == PNG
    assert calls == ["images.example"]
    assert allowed.hits == [("/ok.png", f"images.example:{port}")] and internal.hits == []
    # A name with an allowed and a forbidden address is refused whole.
    with pytest.raises(FetchRefused, match="::1"):
        get(f"http://both.example:{inside_port}/ok.png", LOOPBACK_ONLY, resolve=lambda h, p: ["127.0.0.1", "::1"])
    assert internal.hits == []


def test_tarpits_fail_by_the_deadline(servers):
    port, _, _, _ = servers
    listener = socket.socket()  # accepts connections (the kernel does) and never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        for url in (f"http://127.0.0.1:{port}/silent", f"http://127.0.0.1:{port}/drip",
                    f"http://127.0.0.1:{listener.getsockname()[1]}/"):
            started = time.monotonic()
            with pytest.raises(FetchRefused, match=r"longer than 1 s \(MLXQ_IMAGE_FETCH_TIMEOUT_S\)"):
                get(url, LOOPBACK_ONLY, timeout_s=1.0)
            # bounded by its deadline (a read never waits past it); the margin is for a loaded machine
            assert time.monotonic() - started < 3.0, url
    finally:
        listener.close()
    with pytest.raises(FetchRefused, match="exceed the limit of 10 bytes"):
        fetch(f"http://127.0.0.1:{port}/ok.png", max_bytes=10, timeout_s=5, max_redirects=0, policy=LOOPBACK_ONLY)


def test_fifos_and_other_files_that_are_not_regular_are_refused_at_once(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")  # no writer: opening it for reading would wait for ever
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "zero.png").symlink_to("/dev/zero")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "ok.png").write_bytes(PNG)
    policy = ImagePolicy(image_dir=str(tmp_path))
    outcome: dict[str, str] = {}

    def read_all() -> None:
        for name in ("pipe.png", "dir.png", "zero.png", "sub/ok.png"):
            try:
                outcome[name] = "read %d bytes" % len(image_bytes(name, "f", policy))
            except ImageError as exc:
                outcome[name] = str(exc)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), f"a read blocked: {outcome}"
    assert "not a regular file" in outcome["pipe.png"] and "not a regular file" in outcome["dir.png"]
    assert "outside the image directory" in outcome["zero.png"]
    assert outcome["sub/ok.png"] == f"read {len(PNG)} bytes"

"""Fetching an image URL (`MLXQ_IMAGE_FETCH`), to public addresses only.

Each hop of a fetch (the URL, then every redirect) is resolved here, every address the name has is
checked, and the connection goes to the checked address itself, with the name kept for the `Host`
header and the TLS certificate check: a name that resolves to a public address for the check and to
a private one for the connection (DNS rebinding) cannot swap it. An address is allowed if it is
globally routable (no loopback, private, link-local, shared, multicast or reserved range, IPv4 inside
IPv6 included) or inside one of the operator's `MLXQ_IMAGE_FETCH_ALLOW_NETS` (an internal image
store; the tests' loopback servers). Each fetch is bounded: connect and every read within what is
left of its deadline (MLXQ_IMAGE_FETCH_TIMEOUT_S, the whole fetch with its redirects), at most
MLXQ_IMAGE_FETCH_MAX_REDIRECTS hops, and its bytes within MLXQ_MAX_IMAGE_BYTES.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union
from urllib.parse import urljoin, urlsplit

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Resolver = Callable[[str, int], list[str]]  # (host, port) -> the addresses it resolves to


class FetchRefused(ValueError):
    """A fetch that must not happen or did not finish; the message says why, without the field."""


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _embedded_ipv4(address: IPAddress) -> IPAddress:
    """The IPv4 address inside an IPv4-mapped, 6to4 or Teredo IPv6 one (what the packets reach)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.sixtofour is not None:
            return address.sixtofour
        if address.teredo is not None:
            return address.teredo[1]
    return address


@dataclass(frozen=True)
class AddressPolicy:
    """Which addresses a fetch may connect to: public ones, and those in `allow_nets`."""

    allow_nets: tuple[Union[ipaddress.IPv4Network, ipaddress.IPv6Network], ...] = ()

    @classmethod
    def parse(cls, nets: Sequence[str]) -> "AddressPolicy":
        """From `MLXQ_IMAGE_FETCH_ALLOW_NETS` (CIDRs such as 10.1.2.0/24 or 127.0.0.2/32)."""
        return cls(tuple(ipaddress.ip_network(net.strip(), strict=False) for net in nets if net.strip()))

    def allowed(self, address: IPAddress) -> bool:
        if any(address in net for net in self.allow_nets if net.version == address.version):
            return True
        reached = _embedded_ipv4(address)
        return (reached.is_global and not reached.is_multicast and not reached.is_reserved
                and not reached.is_unspecified)


def _checked_addresses(host: str, port: int, policy: AddressPolicy, resolve: Resolver) -> list[str]:
    """Every address `host` resolves to, all allowed, or FetchRefused naming the one that is not."""
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
        found = [str(literal)]
    except ValueError:
        try:
            found = resolve(host, port)
        except (OSError, UnicodeError) as exc:
            raise FetchRefused(f"cannot resolve {host!r}: {exc}") from None
    if not found:
        raise FetchRefused(f"{host!r} resolves to no address")
    for text in found:
        address = ipaddress.ip_address(text.split("%")[0])
        if not policy.allowed(address):
            raise FetchRefused(f"{host!r} resolves to {address}, which is not a public address (images are "
                               "fetched from public addresses only; MLXQ_IMAGE_FETCH_ALLOW_NETS adds others)")
    return found


def _deadline_left(deadline: float, timeout_s: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchRefused(f"fetching took longer than {timeout_s:g} s (MLXQ_IMAGE_FETCH_TIMEOUT_S)")
    return left


def fetch(url: str, *, max_bytes: int, timeout_s: float, max_redirects: int, policy: AddressPolicy,
          resolve: Resolver = system_resolver, deadline: float | None = None) -> bytes:
    """The body at `url`, following at most `max_redirects` redirects, each hop's address checked
    and connected to as checked; FetchRefused for anything else."""
    import httpx

    deadline = time.monotonic() + timeout_s if deadline is None else deadline
    for hop in range(max_redirects + 1):
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise FetchRefused(f"{'a redirect to ' if hop else ''}{url[:200]!r} is not an http(s) URL")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError as exc:
            raise FetchRefused(f"{url[:200]!r}: {exc}") from None
        address = _checked_addresses(parts.hostname, port, policy, resolve)[0]
        pinned = f"[{address}]" if ":" in address else address
        netloc = f"{pinned}:{port}"
        target = parts._replace(netloc=netloc).geturl()
        host_header = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        left = _deadline_left(deadline, timeout_s)
        try:
            with httpx.Client(timeout=httpx.Timeout(left), follow_redirects=False, trust_env=False) as client:
                request = client.build_request("GET", target, headers={"Host": host_header},
                                               extensions={"sni_hostname": parts.hostname})
                response = client.send(request, stream=True)
                try:
                    if response.is_redirect:
                        location = response.headers.get("location", "")
                        url = urljoin(url, location)
                        continue
                    response.raise_for_status()
                    return _body(response, max_bytes, deadline, timeout_s)
                finally:
                    response.close()
        except httpx.TimeoutException:
            raise FetchRefused(f"fetching took longer than {timeout_s:g} s (MLXQ_IMAGE_FETCH_TIMEOUT_S)") from None
        except httpx.HTTPError as exc:
            raise FetchRefused(f"fetching the image failed: {exc}") from None
    raise FetchRefused(f"more than {max_redirects} redirects (MLXQ_IMAGE_FETCH_MAX_REDIRECTS)")


def _body(response: object, max_bytes: int, deadline: float, timeout_s: float) -> bytes:
    import httpx

    assert isinstance(response, httpx.Response)
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise FetchRefused(f"{declared} bytes of image exceed the limit of {max_bytes} bytes (MLXQ_MAX_IMAGE_BYTES)")
    chunks, size = [], 0
    for chunk in response.iter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise FetchRefused(f"more than {max_bytes} bytes of image exceed the limit of {max_bytes} bytes "
                               "(MLXQ_MAX_IMAGE_BYTES)")
        _deadline_left(deadline, timeout_s)
        chunks.append(chunk)
    return b"".join(chunks)

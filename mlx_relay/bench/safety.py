"""Where load may go: loopback only, unless the user names a host with `--allow-host HOST`.

`check_target` resolves the URL's host and refuses it (`UnsafeTarget`) unless every address it
resolves to is loopback (127.0.0.0/8, ::1, IPv4-mapped loopback) or the host was allowed by
name. It runs before anything is sent to the target.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from mlx_relay.bench.errors import TargetError, UnsafeTarget


def is_loopback_address(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def target_host(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise TargetError(f"target {url!r}: the URL must start with http:// or https://")
    if not parts.hostname:
        raise TargetError(f"target {url!r}: no host in the URL")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise TargetError(f"target {url!r}: {exc}") from None
    return parts.hostname, port


def resolve(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UnsafeTarget(f"cannot resolve target host {host!r} ({exc}); refusing to send anything") from None
    return sorted({str(info[4][0]) for info in infos})


def check_target(url: str, allow_hosts: Sequence[str] = ()) -> str:
    """Return the URL's host if load may go there; raise `UnsafeTarget` (or `TargetError`)."""
    host, port = target_host(url)
    if host.lower().rstrip(".") in {h.lower().rstrip(".") for h in allow_hosts}:
        return host
    addresses = resolve(host, port)
    outside = [a for a in addresses if not is_loopback_address(a)]
    if outside or not addresses:
        raise UnsafeTarget(
            f"refusing to load {host!r}: it resolves to {', '.join(addresses) or 'nothing'}, which is not loopback. "
            f"Benchmarks target 127.0.0.1/localhost/::1 only; pass --allow-host {host} to load this host on purpose."
        )
    return host

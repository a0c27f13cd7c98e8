"""Guarded http(s) fetching for the MediaRouter (only when `MediaConfig.allow_remote` is set).

The SSRF guard: the host name is resolved once, every address it resolves to is checked (loopback,
private, link-local, shared, multicast, reserved and unspecified addresses are refused unless
`allow_private_networks`), and the connection goes to the checked address itself (the URL's host
is replaced by the IP; `Host` and TLS SNI/certificate checks keep the name), so a second DNS answer
cannot redirect it. Redirects are followed by hand, each hop checked like the first. Environment
proxies are ignored. The body is streamed and abandoned past `max_media_bytes`; one deadline
(`fetch_timeout_s`) covers resolution, connection, redirects and body.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

import anyio

from mlx_relay.config import MediaConfig
from mlx_relay.media.errors import MediaFetchError, MediaSourceNotAllowed
from mlx_relay.media.limits import check_bytes

if TYPE_CHECKING:
    import httpx

__all__ = ["address_is_public", "fetch_remote", "resolve_checked"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def address_is_public(ip: IPAddress) -> bool:
    """True for a globally routable unicast address; False for loopback, private, link-local,
    shared (CGNAT), multicast, reserved and unspecified ones (IPv4-mapped IPv6 judged as IPv4)."""
    if isinstance(ip, ipaddress.IPv6Address):
        for embedded in (ip.ipv4_mapped, ip.sixtofour):
            if embedded is not None and not address_is_public(embedded):
                return False
        if ip.teredo is not None and not all(address_is_public(a) for a in ip.teredo):
            return False
    return ip.is_global and not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
        or ip.is_unspecified
    )


async def resolve_checked(host: str, port: int, config: MediaConfig, label: str) -> IPAddress:
    """The address to connect to for `host`; refuses the host if any of its addresses is not public
    (unless `config.allow_private_networks`)."""
    try:
        addresses: list[IPAddress] = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, ValueError):  # gaierror, or a name IDNA cannot encode
            raise MediaFetchError(f"{label}: cannot resolve host {host!r}") from None
        addresses = []
        for _family, _type, _proto, _name, sockaddr in infos:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            if ip not in addresses:
                addresses.append(ip)
    if not addresses:
        raise MediaFetchError(f"{label}: cannot resolve host {host!r}")
    if not config.allow_private_networks:
        for ip in addresses:
            if not address_is_public(ip):
                raise MediaSourceNotAllowed(
                    f"{label}: host {host!r} resolves to a loopback, private, link-local or reserved address "
                    f"({ip}); the operator can allow these with MediaConfig.allow_private_networks"
                )
    return addresses[0]


async def fetch_remote(url: str, config: MediaConfig, label: str) -> bytes:
    """GET `url` within the guard, the redirect budget, the deadline and the byte limit."""
    try:
        with anyio.fail_after(config.fetch_timeout_s):
            return await _fetch(url, config, label)
    except TimeoutError:
        raise MediaFetchError(f"{label}: fetching the URL timed out after {config.fetch_timeout_s:g}s") from None


async def _fetch(url: str, config: MediaConfig, label: str) -> bytes:
    import httpx  # only needed when remote fetching is enabled

    try:
        current = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        raise MediaFetchError(f"{label}: malformed URL") from None
    timeout = httpx.Timeout(config.fetch_timeout_s)
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=timeout) as client:
        for _hop in range(config.max_redirects + 1):
            if current.scheme not in ("http", "https") or not current.host:
                raise MediaSourceNotAllowed(f"{label}: only http(s) URLs with a host are fetched")
            port = current.port or (443 if current.scheme == "https" else 80)
            ip = await resolve_checked(current.host, port, config, label)
            request = client.build_request(
                "GET",
                current.copy_with(host=str(ip)),
                headers={"Host": current.netloc.decode("ascii"), "Accept-Encoding": "identity"},
                extensions={"sni_hostname": current.host} if current.scheme == "https" else {},
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise MediaFetchError(f"{label}: fetching from {current.host!r} failed: {type(exc).__name__}") from None
            try:
                if response.status_code in _REDIRECTS and "location" in response.headers:
                    try:
                        current = current.join(response.headers["location"])
                    except (httpx.InvalidURL, ValueError):
                        raise MediaFetchError(f"{label}: malformed redirect location") from None
                    continue
                if response.status_code != 200:
                    raise MediaFetchError(
                        f"{label}: fetching from {current.host!r} failed with HTTP {response.status_code}"
                    )
                return await _read_body(response, config, label)
            finally:
                await response.aclose()
    raise MediaFetchError(f"{label}: more than {config.max_redirects} redirects (MediaConfig.max_redirects)")


async def _read_body(response: httpx.Response, config: MediaConfig, label: str) -> bytes:
    import httpx

    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit():
        check_bytes(int(declared), config, label)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            check_bytes(size, config, label)  # stop reading as soon as the limit is passed
            chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise MediaFetchError(f"{label}: reading the response failed: {type(exc).__name__}") from None
    return b"".join(chunks)

"""Fetching a media part's URL into bytes, for the MediaRouter: data URLs, local files, http(s).

What is fetched is the operator's choice (`MediaConfig`): `data:` URLs always; a plain path or a
`file://` URL only inside `allowed_local_dir` (symlinks and `..` resolved before the containment
check); http(s) only with `allow_remote` (see `mlx_relay.media.remote` for the address guard).
Anything else is refused with a 400 that names the setting that would allow it. Sizes are checked
before decoding: base64 by its length, files by `fstat`, downloads while streaming.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from types import MappingProxyType
from urllib.parse import unquote, urlsplit

import anyio

from mlx_relay.config import MediaConfig
from mlx_relay.media.errors import MediaDecodeError, MediaFetchError, MediaSourceNotAllowed
from mlx_relay.media.items import FetchedMedia, MediaKind
from mlx_relay.media.limits import base64_decoded_size, check_bytes
from mlx_relay.media.remote import fetch_remote

__all__ = ["DATA_URL_TYPES", "decode_data_url", "fetch_media", "read_local_file", "url_scheme"]

#: Media types a `data:` URL may declare, per kind of part.
DATA_URL_TYPES: Mapping[MediaKind, frozenset[str]] = MappingProxyType({
    "image": frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}),
    "video": frozenset({"video/mp4"}),
})

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*):")
_WHITESPACE = re.compile(r"\s+")
_SOURCES_HINT = (
    "use a data: URL, an http(s) URL (needs MediaConfig.allow_remote) or a local path "
    "(needs MediaConfig.allowed_local_dir)"
)


def url_scheme(url: str) -> str:
    """The URL's scheme, lower-cased; "" for a plain path. Looks only at the start of the string."""
    match = _SCHEME.match(url[:64])
    return match.group(1).lower() if match else ""


async def fetch_media(url: str, kind: MediaKind, config: MediaConfig, label: str) -> FetchedMedia:
    """The bytes behind `url`, within `config`'s sources and byte limit; a `MediaError` otherwise."""
    scheme = url_scheme(url)
    if scheme == "data":
        data = await anyio.to_thread.run_sync(partial(decode_data_url, url, kind, config, label))
        return FetchedMedia(kind=kind, data=data, source="data", label=label)
    if scheme in ("http", "https"):
        if not config.allow_remote:
            raise MediaSourceNotAllowed(
                f"{label}: {scheme} URLs are not fetched by this server; the operator can enable them with "
                "MediaConfig.allow_remote (or send the media inline as a base64 data: URL)"
            )
        data = await fetch_remote(url, config, label)
        return FetchedMedia(kind=kind, data=data, source="http", label=label)
    if scheme in ("", "file"):
        data = await anyio.to_thread.run_sync(partial(read_local_file, url, config, label))
        return FetchedMedia(kind=kind, data=data, source="file", label=label)
    raise MediaSourceNotAllowed(f"{label}: unsupported URL scheme {scheme!r}; {_SOURCES_HINT}")


# ---------------------------------------------------------------------------------------------------------
# data: URLs
# ---------------------------------------------------------------------------------------------------------


def decode_data_url(url: str, kind: MediaKind, config: MediaConfig, label: str) -> bytes:
    """The payload of a base64 `data:` URL whose declared media type suits `kind`."""
    comma = url.find(",", 0, 512)
    if url[:5].lower() != "data:" or comma < 0:
        raise MediaFetchError(f"{label}: malformed data: URL (expected data:<media type>;base64,<data>)")
    params = [p.strip().lower() for p in url[5:comma].split(";")]
    media_type, flags = params[0], params[1:]
    allowed = DATA_URL_TYPES[kind]
    if media_type not in allowed:
        raise MediaDecodeError(
            f"{label}: data: URL media type {media_type or '(none)'!r} is not accepted for an {kind} part; "
            f"accepted: {', '.join(sorted(allowed))}"
        )
    if "base64" not in flags:
        raise MediaFetchError(f"{label}: data: URLs must be base64-encoded (data:{media_type};base64,...)")
    payload = url[comma + 1:]
    if _WHITESPACE.search(payload):
        payload = _WHITESPACE.sub("", payload)
    check_bytes(base64_decoded_size(len(payload)) - 2, config, label)  # before decoding anything
    if "-" in payload or "_" in payload:  # the URL-safe alphabet
        payload = payload.translate(str.maketrans("-_", "+/"))
    missing = -len(payload) % 4
    if missing == 3 or not payload:
        raise MediaFetchError(f"{label}: malformed base64 in data: URL")
    try:
        data = base64.b64decode(payload + "=" * missing, validate=True)
    except (binascii.Error, ValueError):
        raise MediaFetchError(f"{label}: malformed base64 in data: URL") from None
    check_bytes(len(data), config, label)
    return data


# ---------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------


def _local_path(url: str, label: str) -> str:
    if url_scheme(url) != "file":
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaSourceNotAllowed(f"{label}: file:// URLs with a host ({parts.netloc!r}) are not accepted")
    return unquote(parts.path)


def read_local_file(url: str, config: MediaConfig, label: str) -> bytes:
    """A regular file's bytes, only if it resolves (symlinks, `..`) inside `config.allowed_local_dir`.

    A relative path is taken relative to the allowed directory. Messages never say whether a path
    outside the directory exists.
    """
    if config.allowed_local_dir is None:
        raise MediaSourceNotAllowed(
            f"{label}: {url[:80]!r} is not a data: or http(s) URL, and local files are not read by this "
            "server; the operator can allow files under one directory with MediaConfig.allowed_local_dir"
        )
    raw = _local_path(url, label)
    if not raw or "\x00" in raw:
        raise MediaFetchError(f"{label}: empty or invalid local path")
    root = Path(config.allowed_local_dir).resolve()
    target = (root / raw).resolve()  # an absolute `raw` replaces `root`; symlinks and `..` are resolved
    if not target.is_relative_to(root):
        raise MediaSourceNotAllowed(
            f"{label}: local path is outside the directory this server may read (MediaConfig.allowed_local_dir)"
        )
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)  # O_NONBLOCK: a FIFO must not block the worker thread
    except FileNotFoundError:
        raise MediaFetchError(f"{label}: local file not found") from None
    except OSError:
        raise MediaFetchError(f"{label}: local file cannot be read") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaFetchError(f"{label}: local path is not a regular file")
        check_bytes(info.st_size, config, label)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(config.max_media_bytes + 1)
    finally:
        os.close(fd)
    check_bytes(len(data), config, label)
    return data

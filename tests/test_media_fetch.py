"""MediaRouter fetching: data URLs, confined local files and guarded http(s) (loopback servers only)."""

from __future__ import annotations

import base64
import io
import ipaddress
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from mlx_relay.bench.images import png_bytes
from mlx_relay.config import MediaConfig
from mlx_relay.errors import InvalidRequest
from mlx_relay.http.errors import error_response
from mlx_relay.media.errors import (
    MediaDecodeError,
    MediaFetchError,
    MediaSourceNotAllowed,
    MediaTooLarge,
)
from mlx_relay.media.fetch import decode_data_url, fetch_media, read_local_file, url_scheme
from mlx_relay.media.remote import address_is_public

PNG = png_bytes([1], 40, 30)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def encoded(fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(PNG)).save(buf, format=fmt, **kw)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------
# data: URLs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "media_type"), [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                                 ("WEBP", "image/webp"), ("GIF", "image/gif")])
async def test_data_url_images(fmt: str, media_type: str) -> None:
    raw = encoded(fmt)
    item = await fetch_media(data_url(raw, media_type), "image", MediaConfig(), "media item 1 (image)")
    assert item.data == raw and item.source == "data" and item.kind == "image"


def test_data_url_tolerates_whitespace_urlsafe_and_missing_padding() -> None:
    payload = base64.urlsafe_b64encode(PNG).decode().rstrip("=")
    wrapped = "\n".join(payload[i:i + 76] for i in range(0, len(payload), 76))
    assert decode_data_url(f"data:image/png;base64,{wrapped}", "image", MediaConfig(), "x") == PNG


@pytest.mark.parametrize("url", [
    "data:image/png;base64,!!!not base64!!!",
    "data:image/png;base64,iVBORw0KGgo%",
    "data:image/png;base64,A",  # one char: cannot be base64
    "data:image/png;base64,",
    "data:image/png;base64",  # no comma
    "data:image/png,raw-bytes-not-base64",
])
def test_malformed_data_urls_are_400(url: str) -> None:
    with pytest.raises(MediaFetchError) as info:
        decode_data_url(url, "image", MediaConfig(), "media item 1 (image)")
    assert info.value.status == 400 and "media item 1 (image)" in info.value.message


@pytest.mark.parametrize(("media_type", "kind"), [("text/plain", "image"), ("image/svg+xml", "image"),
                                                  ("video/mp4", "image"), ("image/png", "video"), ("", "image")])
def test_data_url_wrong_media_type_is_400(media_type: str, kind: str) -> None:
    with pytest.raises(MediaDecodeError, match="media type"):
        decode_data_url(data_url(PNG, media_type), kind, MediaConfig(), "x")  # type: ignore[arg-type]


def test_data_url_byte_limit_before_decoding() -> None:
    with pytest.raises(MediaTooLarge, match="max_media_bytes"):
        decode_data_url(data_url(b"\0" * 5000), "image", MediaConfig(max_media_bytes=1000), "x")
    assert decode_data_url(data_url(b"\0" * 1000), "image", MediaConfig(max_media_bytes=1000), "x") == b"\0" * 1000


def test_errors_answer_400_in_openai_shape() -> None:
    response = error_response(MediaFetchError("media item 1 (image): malformed base64 in data: URL"))
    assert response.status_code == 400
    body = msgspec.json.decode(response.body)
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "media_fetch_failed" and body["error"]["param"] == "messages"
    assert issubclass(MediaFetchError, InvalidRequest)


@pytest.mark.parametrize(("url", "scheme"), [("data:x", "data"), ("HTTPS://a", "https"), ("/tmp/a.png", ""),
                                             ("a.png", ""), ("https", ""), ("ftp://h/x", "ftp"), ("file:///a", "file")])
def test_url_scheme(url: str, scheme: str) -> None:
    assert url_scheme(url) == scheme


async def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(MediaSourceNotAllowed, match="unsupported URL scheme 'ftp'"):
        await fetch_media("ftp://example.com/a.png", "image", MediaConfig(), "x")


# ---------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(PNG)
    (allowed / "sub").mkdir()
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"secret")
    return allowed, secret


async def test_local_files_refused_without_allowed_dir(dirs: tuple[Path, Path]) -> None:
    allowed, _ = dirs
    for url in (str(allowed / "a.png"), (allowed / "a.png").as_uri(), "https"):
        with pytest.raises(MediaSourceNotAllowed, match=r"MediaConfig\.allowed_local_dir"):
            await fetch_media(url, "image", MediaConfig(), "x")


async def test_local_file_inside_allowed_dir(dirs: tuple[Path, Path]) -> None:
    allowed, _ = dirs
    config = MediaConfig(allowed_local_dir=str(allowed))
    for url in (str(allowed / "a.png"), (allowed / "a.png").as_uri(), "a.png", "sub/../a.png",
                f"file://localhost{allowed / 'a.png'}"):
        item = await fetch_media(url, "image", config, "x")
        assert item.data == PNG and item.source == "file"
    (allowed / "inner-link.png").symlink_to(allowed / "a.png")
    assert read_local_file(str(allowed / "inner-link.png"), config, "x") == PNG


def test_local_file_escapes_are_refused(dirs: tuple[Path, Path]) -> None:
    allowed, secret = dirs
    config = MediaConfig(allowed_local_dir=str(allowed))
    (allowed / "link.png").symlink_to(secret)
    (allowed / "dirlink").symlink_to(secret.parent)
    for url in (str(secret), secret.as_uri(), f"{allowed}/../secret.png", "../secret.png",
                str(allowed / "link.png"), "link.png", "dirlink/secret.png", "/etc/passwd"):
        with pytest.raises(MediaSourceNotAllowed, match="outside the directory") as info:
            read_local_file(url, config, "x")
        assert "secret" not in info.value.message


def test_local_file_errors(dirs: tuple[Path, Path]) -> None:
    allowed, _ = dirs
    config = MediaConfig(allowed_local_dir=str(allowed), max_media_bytes=100)
    with pytest.raises(MediaFetchError, match="not found"):
        read_local_file("missing.png", config, "x")
    with pytest.raises(MediaFetchError, match="not a regular file"):
        read_local_file("sub", config, "x")
    os.mkfifo(allowed / "fifo")
    # must not block waiting for a writer (none ever comes: a blocking open would hang, so it runs
    # on a thread the test gives up on after 30 s, a hang guard; the check is the refusal)
    raised: list[BaseException] = []

    def read_fifo() -> None:
        try:
            read_local_file("fifo", config, "x")
        except BaseException as exc:
            raised.append(exc)

    reader = threading.Thread(target=read_fifo, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert len(raised) == 1 and isinstance(raised[0], MediaFetchError), raised
    assert "not a regular file" in str(raised[0])
    with pytest.raises(MediaTooLarge):
        read_local_file("a.png", config, "x")
    with pytest.raises(MediaSourceNotAllowed, match="host"):
        read_local_file(f"file://otherhost{allowed / 'a.png'}", config, "x")


# ---------------------------------------------------------------------------------------------------------
# http(s): a loopback server in a thread
# ---------------------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        try:
            self._route()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _route(self) -> None:
        if self.path == "/img.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif self.path == "/host":
            self._send(200, self.headers.get("Host", "").encode())
        elif self.path == "/redirect":
            self._send(302, headers={"Location": "/img.png"})
        elif self.path == "/to-ipv6-loopback":
            self._send(302, headers={"Location": f"http://[::1]:{self.server.server_address[1]}/img.png"})
        elif self.path == "/loop":
            self._send(302, headers={"Location": "/loop"})
        elif self.path == "/declared-big":
            self._send(200, b"x" * 10, {"Content-Length": str(10**9)})
        elif self.path == "/stream-big":  # no Content-Length: the body ends when the connection closes
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * 65536)
        elif self.path == "/slow":
            time.sleep(1.5)
            self._send(200, PNG)
        else:
            self._send(404, b"no")


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


LOOPBACK_OK = MediaConfig(allow_remote=True, allow_private_networks=True)


async def test_remote_refused_by_default(http_server: str) -> None:
    for url in (f"{http_server}/img.png", "https://example.com/cat.png"):
        with pytest.raises(MediaSourceNotAllowed, match=r"MediaConfig\.allow_remote"):
            await fetch_media(url, "image", MediaConfig(), "x")


async def test_loopback_refused_even_with_remote_on(http_server: str) -> None:
    port = http_server.rsplit(":", 1)[1]
    config = MediaConfig(allow_remote=True)
    for url in (f"{http_server}/img.png", f"http://localhost:{port}/img.png", f"http://[::1]:{port}/img.png",
                f"http://[::ffff:127.0.0.1]:{port}/img.png", "http://10.1.2.3/x.png", "http://169.254.169.254/"):
        with pytest.raises(MediaSourceNotAllowed, match="allow_private_networks"):
            await fetch_media(url, "image", config, "x")


async def test_loopback_allowed_with_private_networks(http_server: str) -> None:
    item = await fetch_media(f"{http_server}/img.png", "image", LOOPBACK_OK, "x")
    assert item.data == PNG and item.source == "http"
    host = await fetch_media(f"{http_server}/host", "image", LOOPBACK_OK, "x")
    assert host.data.decode() == http_server.removeprefix("http://")  # Host keeps the URL's name and port
    redirected = await fetch_media(f"{http_server}/redirect", "image", LOOPBACK_OK, "x")
    assert redirected.data == PNG


async def test_each_redirect_hop_is_checked(http_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_relay.media.remote as remote

    # pretend 127.0.0.1 is a public address: the first hop passes, the redirect to ::1 must not
    monkeypatch.setattr(remote, "address_is_public", lambda ip: str(ip) == "127.0.0.1")
    config = MediaConfig(allow_remote=True)
    assert (await fetch_media(f"{http_server}/redirect", "image", config, "x")).data == PNG
    with pytest.raises(MediaSourceNotAllowed, match="allow_private_networks"):
        await fetch_media(f"{http_server}/to-ipv6-loopback", "image", config, "x")


async def test_remote_failures(http_server: str) -> None:
    with pytest.raises(MediaFetchError, match="redirects"):
        await fetch_media(f"{http_server}/loop", "image", LOOPBACK_OK, "x")
    with pytest.raises(MediaFetchError, match="HTTP 404"):
        await fetch_media(f"{http_server}/nothing", "image", LOOPBACK_OK, "x")
    with pytest.raises(MediaFetchError, match="timed out"):
        await fetch_media(f"{http_server}/slow", "image", msgspec.structs.replace(LOOPBACK_OK, fetch_timeout_s=0.3),
                          "x")
    with pytest.raises(MediaFetchError, match="cannot resolve"):
        await fetch_media("http://no-such-host.invalid/x.png", "image", LOOPBACK_OK, "x")


async def test_remote_byte_limit(http_server: str) -> None:
    small = msgspec.structs.replace(LOOPBACK_OK, max_media_bytes=100_000)
    with pytest.raises(MediaTooLarge, match="max_media_bytes"):
        await fetch_media(f"{http_server}/stream-big", "image", small, "x")  # streamed, no Content-Length
    with pytest.raises(MediaTooLarge, match="max_media_bytes"):
        await fetch_media(f"{http_server}/declared-big", "image", small, "x")
    assert (await fetch_media(f"{http_server}/img.png", "image", small, "x")).data == PNG


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True),
    ("127.0.0.1", False), ("10.0.0.1", False), ("172.16.5.4", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("224.0.0.1", False),
    ("240.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("::", False), ("fe80::1", False),
    ("fc00::1", False), ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("2002:7f00:1::", False),
    ("ff02::1", False),
])
def test_address_is_public(address: str, public: bool) -> None:
    assert address_is_public(ipaddress.ip_address(address)) is public

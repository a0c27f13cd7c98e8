"""The recording proxy of `make agents`: a loopback forwarder between a coding agent and
`mlx-relay serve` that writes down every exchange (one JSON file each, in the order the requests
arrived).

A record holds what the agent sent (method, path, headers with the secrets replaced, the body as
JSON) and what it got back (status, content type, the `x-request-id` the server logged it under,
the whole body: the SSE text of a stream, keep-alives included, as the agent read it;
`client_closed` when the agent stopped reading first).
Bodies are forwarded byte for byte; only hop-by-hop headers are dropped and `accept-encoding` is
set to identity so that the recording is readable. The fixtures of `tests/test_agent_requests.py` are these records.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

SECRET_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "cookie", "proxy-authorization"})
HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                         "te", "trailer", "accept-encoding"})
REDACTED = "<redacted>"


def redact(headers: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if k in SECRET_HEADERS else v) for k, v in headers.items()}


def parse_body(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", errors="replace")


class Recorder:
    """Forwards every request to `upstream` and writes each exchange under `out` (set per agent)."""

    def __init__(self, upstream: str, port: int) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.out: Path | None = None
        self._seq = 0
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/{path:path}", self._forward,
                                      methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                     timeout_keep_alive=600))
        self._thread = threading.Thread(target=self._server.run, name="recorder", daemon=True)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None))

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def record_to(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.out, self._seq = out, 0

    def _next(self) -> tuple[int, Path | None]:
        with self._lock:
            self._seq += 1
            return self._seq, self.out

    async def _forward(self, request: Request) -> Response:
        seq, out = self._next()
        raw = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        sent = {k.lower(): v for k, v in request.headers.items()}
        record: dict[str, Any] = {"seq": seq, "method": request.method, "path": path, "headers": redact(sent),
                                  "body": parse_body(raw), "started": time.time()}
        headers = {k: v for k, v in sent.items() if k not in HOP_HEADERS} | {"accept-encoding": "identity"}
        upstream = self._client.build_request(request.method, self.upstream + path, headers=headers, content=raw)
        try:
            reply = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            record |= {"status": 502, "error": repr(exc), "duration_s": time.time() - record["started"]}
            self._write(out, seq, record)
            return Response(f"recording proxy: upstream failed: {exc!r}", status_code=502)
        record |= {"status": reply.status_code, "content_type": reply.headers.get("content-type", ""),
                   "request_id": reply.headers.get("x-request-id")}  # the server's request log line's
        passed = {k: v for k, v in reply.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}

        async def body() -> AsyncIterator[bytes]:
            chunks: list[bytes] = []
            record["client_closed"] = True  # until the whole answer has gone through
            try:
                async for chunk in reply.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
                record["client_closed"] = False
            finally:
                await reply.aclose()
                record["response"] = b"".join(chunks).decode("utf-8", errors="replace")
                record["duration_s"] = round(time.time() - record["started"], 3)
                self._write(out, seq, record)

        return StreamingResponse(body(), status_code=reply.status_code, headers=passed)

    @staticmethod
    def _write(out: Path | None, seq: int, record: dict[str, Any]) -> None:
        if out is not None:
            (out / f"{seq:03d}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")

"""The HTTP driver: streams `/v1/chat/completions` from any OpenAI-compatible server (ours,
`mlx_lm.server`, `mlx_vlm.server`, ...) and measures and checks every stream it reads.

Each request is sent with `stream: true, stream_options: {include_usage: true}`; the body is
read line by line into a `StreamChecker` with arrival times. A non-200 answer, a timeout, a
refused or broken connection become the measurement's error kind; nothing is raised. The
target is checked by `mlx_relay.bench.safety` before anything is sent, proxies from the
environment are ignored and redirects are not followed, so load stays where it was aimed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import msgspec

from mlx_relay.bench.records import ErrorKind, Measurement, Outcome, error_kind_for_status
from mlx_relay.bench.safety import check_target, target_host
from mlx_relay.bench.sse_check import StreamChecker
from mlx_relay.bench.workload import BenchRequest


def api_base(url: str) -> str:
    """`http://host:port` or `http://host:port/v1` -> `http://host:port/v1`."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def request_body(request: BenchRequest, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if request.seed is not None:
        body["seed"] = request.seed
    if request.tools:
        body["tools"] = request.tools
    return body


async def discover_model(client: httpx.AsyncClient, base: str) -> str | None:
    """The first model `GET /v1/models` lists, or None (the body then names no model)."""
    try:
        r = await client.get(base + "/models", timeout=10.0)
        data = r.json().get("data") if r.status_code == 200 else None
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


class HttpDriver:
    def __init__(self, client: httpx.AsyncClient, *, url: str, label: str, model: str | None,
                 timeout_s: float) -> None:
        self.client = client
        self.description = url
        self.label = label
        self.model = model
        self.timeout_s = timeout_s
        self.chat_url = api_base(url) + "/chat/completions"

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        url: str,
        *,
        label: str | None = None,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_connections: int = 512,
        allow_hosts: Sequence[str] = (),
    ) -> AsyncIterator[HttpDriver]:
        """Check the target (loopback or allowed, see `safety`), open a connection pool, find the
        served model if none is given."""
        await anyio.to_thread.run_sync(check_target, url, tuple(allow_hosts))
        host, port = target_host(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        async with httpx.AsyncClient(
            trust_env=False,
            follow_redirects=False,
            headers=headers,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
        ) as client:
            chosen = model or await discover_model(client, api_base(url))
            yield cls(client, url=url, label=label or f"{host}:{port}", model=chosen, timeout_s=timeout_s)

    async def send(self, request: BenchRequest) -> Outcome:
        checker = StreamChecker(expect_usage=True)
        t0 = time.perf_counter()
        measurement: Measurement | None = None
        with anyio.move_on_after(self.timeout_s):
            try:
                measurement = await self._stream(request_body(request, self.model), f"{self.label}/{request.id}",
                                                 checker, t0)
            except httpx.TimeoutException as exc:
                measurement = _failed(checker, time.perf_counter() - t0, "timeout", repr(exc))
            except httpx.TransportError as exc:  # refused, reset, closed mid-stream
                measurement = _failed(checker, time.perf_counter() - t0, "connection", repr(exc))
        if measurement is None:
            measurement = _failed(checker, time.perf_counter() - t0, "timeout",
                                  f"no complete answer within {self.timeout_s:g}s")
        return Outcome(measurement, checker.text)

    async def _stream(self, body: dict[str, Any], request_id: str, checker: StreamChecker, t0: float) -> Measurement:
        content = msgspec.json.encode(body)
        # the target's label and the request's id as `x-request-id`: the server's request log names it
        # (a cluster's replica too)
        async with self.client.stream("POST", self.chat_url, content=content,
                                      headers={"Content-Type": "application/json", "x-request-id": request_id}) as r:
            if r.status_code != 200:
                raw = await r.aread()
                detail = f"HTTP {r.status_code}: {raw[:300].decode('utf-8', 'replace')}"
                return Measurement(e2e_s=time.perf_counter() - t0, error=error_kind_for_status(r.status_code),
                                   error_detail=detail)
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                checker.violate("not_event_stream")
            async for line in r.aiter_lines():
                checker.feed(line, time.perf_counter() - t0)
        return checker.close(time.perf_counter() - t0)


def _failed(checker: StreamChecker, t: float, kind: ErrorKind, detail: str) -> Measurement:
    """What was read before the failure, marked with the failure."""
    return msgspec.structs.replace(checker.measurement(t), error=kind, error_detail=detail)

"""A scripted OpenAI-compatible server for testing the harness: well-formed and broken streams.

The path's first segment picks the behaviour, so one server serves them all:
`POST /{mode}/v1/chat/completions` (and `GET /{mode}/v1/models`), e.g. a target URL
`http://127.0.0.1:PORT/no_done`. Modes: see `MODES`. It is a double of an HTTP server, not of
the engine: it answers at once with `n` chunks "w0 ", "w1 ", ... (n = max_tokens, at most 8),
each after `chunk_delay_s` (the `slow` mode waits 50 ms a chunk).

    with DoubleServer() as double:
        url = double.url + "/good"
"""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODES: tuple[str, ...] = (
    "good",  # a well-formed stream with a usage chunk (prompt 7, cached 3)
    "slow",  # as good, 50 ms before each chunk
    "no_finish",  # no chunk carries a finish_reason
    "double_finish",  # two chunks carry one
    "no_done",  # ends without data: [DONE]
    "bad_json",  # one data line is not JSON
    "bad_shape",  # one chunk is JSON but not a chat.completion.chunk
    "no_object",  # chunks without "object"
    "after_done",  # a chunk after data: [DONE]
    "no_usage",  # no usage chunk
    "error_frame",  # an error object mid-stream, then [DONE]
    "drop",  # the connection breaks mid-stream
    "not_sse",  # a 200 JSON body instead of a stream
    "status_400",
    "status_429",
    "status_500",
)


class DoubleFailure(Exception):
    """Raised inside the `drop` stream so the server aborts the connection."""


def _chunk(delta: dict[str, Any], finish: str | None = None, *, with_object: bool = True) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-double", "created": 0, "model": "double",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if with_object:
        body["object"] = "chat.completion.chunk"
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def _usage(n: int) -> bytes:
    body = {"id": "chatcmpl-double", "object": "chat.completion.chunk", "created": 0, "model": "double",
            "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n,
                                     "prompt_tokens_details": {"cached_tokens": 3}}}
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


async def _stream(mode: str, n: int, delay: float) -> AsyncIterator[bytes]:
    obj = mode != "no_object"
    yield _chunk({"role": "assistant", "content": ""}, with_object=obj)
    for i in range(n):
        if delay:
            await anyio.sleep(delay)
        if mode == "bad_json" and i == 1:
            yield b'data: {"id": "chatcmpl-double", "choices": [\n\n'
        if mode == "bad_shape" and i == 1:
            yield b'data: {"id": "chatcmpl-double", "object": "chat.completion.chunk", "choices": "nope"}\n\n'
        if mode == "error_frame" and i == 2:
            yield b'data: {"error": {"message": "the engine failed", "type": "server_error"}}\n\n'
            yield b"data: [DONE]\n\n"
            return
        if mode == "drop" and i == 2:
            raise DoubleFailure("dropping the connection")
        yield _chunk({"content": f"w{i} "}, with_object=obj)
    if mode != "no_finish":
        yield _chunk({}, "length", with_object=obj)
    if mode == "double_finish":
        yield _chunk({}, "stop", with_object=obj)
    if mode != "no_usage":
        yield _usage(n)
    if mode != "no_done":
        yield b"data: [DONE]\n\n"
    if mode == "after_done":
        yield _chunk({"content": "late"}, with_object=obj)


def create_double_app(chunk_delay_s: float = 0.0) -> Starlette:
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "double", "object": "model"}]})

    async def chat(request: Request) -> Response:
        mode = request.path_params["mode"]
        body = msgspec.json.decode(await request.body())
        if mode not in MODES:
            return JSONResponse({"error": {"message": f"no mode {mode}"}}, status_code=404)
        if mode.startswith("status_"):
            status = int(mode.removeprefix("status_"))
            return JSONResponse({"error": {"message": f"scripted {status}", "type": "scripted"}}, status_code=status)
        n = max(1, min(8, int(body.get("max_tokens") or 8)))
        if mode == "not_sse":
            return JSONResponse({"object": "chat.completion", "choices": []})
        delay = 0.05 if mode == "slow" else chunk_delay_s
        return StreamingResponse(_stream(mode, n, delay), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/{mode}/v1/models", models, methods=["GET"]),
        Route("/{mode}/v1/chat/completions", chat, methods=["POST"]),
    ])


class DoubleServer:
    """The double on a free loopback port, served by uvicorn in a thread. The listening socket
    is bound before the thread starts, so requests may be sent as soon as `__enter__` returns
    (they wait in the backlog until uvicorn accepts them)."""

    def __init__(self, chunk_delay_s: float = 0.0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.port = int(self._socket.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_double_app(chunk_delay_s), log_level="critical", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="bench-double", daemon=True)

    def _run(self) -> None:
        anyio.run(self._server.serve, [self._socket])

    def __enter__(self) -> DoubleServer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()

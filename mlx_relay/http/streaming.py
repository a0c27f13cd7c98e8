"""Response lifetimes shared by every route (OpenAI, Anthropic, Responses): the generation and
its admission slot live in an exit stack that the response owns, and a client that goes away
cancels them through a task group (Starlette's way), never by polling.

- `ScopedStreamingResponse`: an SSE response that runs an optional feeder task beside the body
  (e.g. the task reading the reply into the memory stream the body waits on with keep-alive
  timeouts: cancelling such a wait is harmless, cancelling `anext` on a reply's async generator
  would end it) and closes the stack however the response ends.
- `until_disconnect`: a non-streamed answer, abandoned (and its generation cancelled) when the
  client disconnects first.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TypeVar

import anyio
from anyio.abc import ObjectReceiveStream
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mlx_relay.errors import RelayError

T = TypeVar("T")


class ScopedStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], stack: AsyncExitStack,
                 background_task: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stack = stack
        self._feed = background_task  # cancelled when the body ends

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            failure: Exception | None = None
            async with anyio.create_task_group() as tg:
                if self._feed is not None:
                    tg.start_soon(self._feed)
                try:
                    await super().__call__(scope, receive, send)
                except Exception as exc:  # e.g. ClientDisconnect: raised as itself, not in a group
                    failure = exc
                tg.cancel_scope.cancel()
            if failure is not None:
                raise failure
        finally:
            with anyio.CancelScope(shield=True):
                await self._stack.aclose()


async def watch_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def until_disconnect(request: Request, work: Awaitable[T],
                           feed: Callable[[], Awaitable[None]] | None = None) -> T:
    """Await `work` unless the client goes away first (then the generation is cancelled);
    `feed` runs beside it (e.g. the pumps `work` reads from) and is cancelled with it."""
    result: list[T] = []
    failed: list[Exception] = []

    async def run(scope: anyio.CancelScope) -> None:
        try:
            result.append(await work)
        except Exception as exc:  # re-raised as itself below, not inside an exception group
            failed.append(exc)
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch_disconnect, request, tg.cancel_scope)
        if feed is not None:
            tg.start_soon(feed)
        tg.start_soon(run, tg.cancel_scope)
    if failed:
        raise failed[0]
    if not result:  # the client went away; nobody reads this
        raise RelayError("client disconnected")
    return result[0]


async def with_keepalives(frames: ObjectReceiveStream[bytes], keepalive_s: float) -> AsyncIterator[bytes]:
    """The frames a feeder task writes, with an SSE comment whenever none came for `keepalive_s`
    (slow prefills must not trip clients' read timeouts)."""
    async with frames:
        while True:
            chunk = b": keep-alive\n\n"
            with anyio.move_on_after(keepalive_s):
                try:
                    chunk = await frames.receive()
                except anyio.EndOfStream:
                    return
            yield chunk

"""The one streaming skeleton of every wire format (`http/formats/`: OpenAI chat and
completions, Anthropic Messages, Responses): one pump, one keep-alive, one disconnect path; a
format supplies only an `SSEEncoder` (its frames) and a `Collect` (its non-streamed body), the
two protocols every format implements.

    respond(request, served.use(model), reqs, rid, stream=..., encoder=..., collect=...)
      -> every reply admitted and started (`replies.open_replies`: a refusal is a clean error
         before anything is sent)
      -> stream: `ScopedStreamingResponse(sse_body(...))`, the pumps (`Replies.run`) as its
         feeder task; `sse_body` writes the encoder's frames, an SSE comment whenever nothing
         came for `keepalive_s` (slow prefills must not trip clients' read timeouts), and the
         format's terminal frames however the replies end (done, failed, cut short)
      -> otherwise: `until_disconnect(request, collect(items), pumps)`; a collector reads the
         replies through `choice_events` (n choices) or `reply_events` (one)

The generation and its admission slot live in an exit stack the response owns; a client that
goes away cancels the response's task group (Starlette's way), never polled, and the stack then
ends the generations.

`respond` also fills the request's record for the request log (`http/request_record.py`): the
model, the response id and a `ReplyTally` per choice; `sse_body` adds a failure and whether the
terminal frames went out (a stream without them was cut: the client went away).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Protocol, TypeVar

import anyio
import msgspec
from anyio.abc import ObjectReceiveStream
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlx_relay.chat.output import ReplyDone, ReplyEvent
from mlx_relay.errors import ClientDisconnected, RelayError
from mlx_relay.http.replies import Item, open_replies
from mlx_relay.http.request_record import RequestRecord, record_of
from mlx_relay.service import ChatRequest, ChatService

T = TypeVar("T")

KEEPALIVE = b": keep-alive\n\n"


class SSEEncoder(Protocol):
    """A wire format's frames for one streamed response (each format's `encoder.py`)."""

    @property
    def done(self) -> bool:
        """Every choice has ended (the stream's end follows)."""
        ...

    def start(self) -> list[bytes]:
        """Frames before the first event."""
        ...

    def event(self, index: int, ev: ReplyEvent) -> list[bytes]:
        """Frames for one event of choice `index`."""
        ...

    def failed(self, exc: Exception) -> list[bytes]:
        """The terminal frames when the generation fails after the response started."""
        ...

    def end(self) -> list[bytes]:
        """The terminal frames after every choice ended (usage, `[DONE]`, ...)."""
        ...


Collect = Callable[[ObjectReceiveStream[Item]], Awaitable[msgspec.Struct]]
"""A wire format's non-streamed body from the request's replies (each format's `collector.py`)."""


class ScopedStreamingResponse(StreamingResponse):
    """An SSE response that runs a feeder task beside the body (the pumps the body reads from)
    and closes the response's exit stack however it ends."""

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


async def sse_body(items: ObjectReceiveStream[Item], encoder: SSEEncoder, keepalive_s: float,
                   record: RequestRecord | None = None) -> AsyncIterator[bytes]:
    """The one keep-alive loop: the encoder's frames for the items the pumps send, an SSE
    comment whenever none came for `keepalive_s`, and the terminal frames (waiting is cancelled,
    never the pumps). `record`: told of a failure, and when the terminal frames are out."""
    for frame in encoder.start():
        yield frame
    async with items:
        while not encoder.done:
            item: Item | None = None
            timed_out = True
            with anyio.move_on_after(keepalive_s):
                try:
                    item = await items.receive()
                except anyio.EndOfStream:
                    item = (0, RelayError("the reply ended without finishing"))
                timed_out = False
            if timed_out:
                yield KEEPALIVE
                continue
            assert item is not None
            index, ev = item
            if isinstance(ev, Exception):
                if record is not None:
                    record.fail(ev)
                for frame in encoder.failed(ev):
                    yield frame
                if record is not None:
                    record.stream_ended = True
                return
            for frame in encoder.event(index, ev):
                yield frame
    for frame in encoder.end():
        yield frame
    if record is not None:
        record.stream_ended = True


async def watch_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def until_disconnect(request: Request, work: Awaitable[T],
                           feed: Callable[[], Awaitable[None]] | None = None) -> T:
    """Await `work` unless the client goes away first (then the generation is cancelled);
    `feed` runs beside it (the pumps `work` reads from) and is cancelled with it."""
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
        raise ClientDisconnected("client disconnected")
    return result[0]


async def respond(request: Request, using: AbstractAsyncContextManager[ChatService], reqs: list[ChatRequest],
                  rid: str, *, model: str, stream: bool, encoder: SSEEncoder, collect: Collect, keepalive_s: float,
                  raw: bool = False) -> Response:
    """Every route's response: take the model in use (`using`: `Served.use`, held until the
    response ends; a pool loads the model first), admit and start every choice (a refusal is a
    clean error before anything is sent), then stream the encoder's frames or collect one body."""
    record = record_of(request.scope)
    tallies = record.begin(model, rid, reqs, stream) if record is not None else None
    stack = AsyncExitStack()
    try:
        service = await stack.enter_async_context(using)
        replies = await open_replies(stack, service, reqs, rid, raw=raw, tallies=tallies)
    except BaseException:
        await stack.aclose()
        raise
    if stream:
        return ScopedStreamingResponse(sse_body(replies.receive, encoder, keepalive_s, record), stack, replies.run)
    async with stack:
        body = await until_disconnect(request, collect(replies.receive), replies.run)
    return Response(msgspec.json.encode(body), media_type="application/json")


async def choice_events(items: ObjectReceiveStream[Item], n: int) -> AsyncIterator[tuple[int, ReplyEvent]]:
    """The events of `n` choices from the merged stream, until every choice's `ReplyDone` (a
    failure raised as itself; replies that end without finishing are a `RelayError`)."""
    finished: set[int] = set()
    async for index, ev in items:
        if isinstance(ev, Exception):
            raise ev
        yield index, ev
        if isinstance(ev, ReplyDone):
            finished.add(index)
            if len(finished) == n:
                return
    raise RelayError("the reply ended without finishing")


async def reply_events(items: ObjectReceiveStream[Item]) -> AsyncIterator[ReplyEvent]:
    """One reply's events, up to its `ReplyDone`: for the collectors of single-choice formats."""
    async for _, ev in choice_events(items, 1):
        yield ev

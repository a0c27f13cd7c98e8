"""Reply channels: a one-shot future for `ask`, an item stream for `stream`.

Both are created by the asker and travel in the envelope. A stream is consumed inside an
`async with` block; leaving the block before the stream has ended (a client disconnect, a
cancelled task) tells the owning actor, through its control lane, that the request was
cancelled, so it stops the work and frees the slot. Nothing polls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import anyio
import msgspec


class _End:
    __slots__ = ()


class _Fail:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = _End()


class ReplyFuture:
    """A reply that arrives once: a value or an exception."""

    __slots__ = ("_done", "_exc", "_value")

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._value: Any = None
        self._exc: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def set(self, value: Any) -> None:
        if not self.done:
            self._value = value
            self._done.set()

    def fail(self, exc: BaseException) -> None:
        if not self.done:
            self._exc = exc
            self._done.set()

    async def wait(self) -> Any:
        await self._done.wait()
        if self._exc is not None:
            raise self._exc
        return self._value


class ReplyStream:
    """A stream of `msgspec.Struct` items from an actor to one consumer.

    The producing actor calls `send`, then `close` or `fail`. The consumer iterates it inside
    `async with`; exiting early marks it cancelled and calls `on_cancel` exactly once.
    """

    def __init__(self, stream_id: int, on_cancel: Callable[[ReplyStream], None]) -> None:
        self.id = stream_id
        self._on_cancel = on_cancel
        self._send, self._recv = anyio.create_memory_object_stream[Any](math.inf)
        self.finished = False  # the producer closed or failed it
        self.cancelled = False  # the consumer left before the end

    # -- producer side (actor, event-loop thread) --------------------------------------------
    @property
    def open(self) -> bool:
        return not (self.finished or self.cancelled)

    def send(self, item: msgspec.Struct) -> bool:
        """Deliver an item; returns False if the stream is already finished or cancelled."""
        if not self.open:
            return False
        self._send.send_nowait(item)
        return True

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            if not self.cancelled:
                self._send.send_nowait(_END)

    def fail(self, exc: BaseException) -> None:
        if not self.finished:
            self.finished = True
            if not self.cancelled:
                self._send.send_nowait(_Fail(exc))

    # -- consumer side -------------------------------------------------------------------------
    def __aiter__(self) -> ReplyStream:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self._recv.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
        if item is _END:
            self._recv.close()
            raise StopAsyncIteration
        if isinstance(item, _Fail):
            self._recv.close()
            raise item.exc
        return item

    async def __aenter__(self) -> ReplyStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Consumer is done; if the producer was not, it is told the request was cancelled."""
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self._on_cancel(self)
        self._recv.close()

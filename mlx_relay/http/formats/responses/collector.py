"""OpenAI Responses API: a whole reply as one response object (the non-streamed body), built
by the same assembly as the stream (`encoder.ResponseAssembler`)."""

from __future__ import annotations

from collections.abc import Callable

from anyio.abc import ObjectReceiveStream

from mlx_relay.http.formats.responses.encoder import ResponseAssembler
from mlx_relay.http.formats.responses.types import ResponseObject
from mlx_relay.http.replies import Item
from mlx_relay.http.streaming import reply_events


async def collect_response(items: ObjectReceiveStream[Item], assembler: ResponseAssembler,
                           finished: Callable[[], None]) -> ResponseObject:
    """The assembler's response once the reply finished; `finished` is told first (it stores it)."""
    async for ev in reply_events(items):
        assembler.feed(ev)
    finished()
    return assembler.response

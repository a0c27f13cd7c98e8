"""n replies of one request, merged into one stream of `(choice index, event)` (`n` > 1 on chat
and completions; n == 1 takes the same path).

The request holds n admission slots, granted together (two requests holding part of what each
needs could otherwise wait on each other forever); each choice is its own `ChatService.reply`
and engine row, so the choices decode together in the batch. All of them are entered before the HTTP response
starts, so a refusal is a clean 4xx/429; a pump task per reply forwards its events, and an
error ends that choice with the exception as its last item. The replies live in the caller's
exit stack; the pumps in a task group of the reading task (`Replies.run`), cancelled before the
stack closes (response done, client gone), which then ends the generations.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, suppress

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from mlx_relay.chat.output import ReplyEvent
from mlx_relay.service import ChatRequest, ChatService

Item = tuple[int, ReplyEvent | BaseException]


def choice_requests(req: ChatRequest, n: int) -> list[ChatRequest]:
    """The n choices: with a seed, choice i samples with seed + i (reproducible and distinct)."""
    if n == 1:
        return [req]
    return [req if req.seed is None else msgspec.structs.replace(req, seed=req.seed + i) for i in range(n)]


class Replies:
    """The merged stream (`receive`) and the pumps that feed it (`run`: run it in a task group of
    the task that reads, and cancel it when done)."""

    def __init__(self, streams: list[AsyncIterator[ReplyEvent]]) -> None:
        self.streams = streams
        self._send, self.receive = anyio.create_memory_object_stream[Item](max_buffer_size=256)

    async def run(self) -> None:
        async with self._send, anyio.create_task_group() as tg:
            for i, events in enumerate(self.streams):
                tg.start_soon(_pump, i, events, self._send.clone())


async def open_replies(stack: AsyncExitStack, service: ChatService, reqs: list[ChatRequest],
                       rid: str, *, raw: bool = False) -> Replies:
    await stack.enter_async_context(service.admit(rid, len(reqs)))
    streams: list[AsyncIterator[ReplyEvent]] = []
    for i, req in enumerate(reqs):
        ctx = service.reply(req, rid if i == 0 else f"{rid}-{i}", admitted=True, raw=raw)
        streams.append(await stack.enter_async_context(ctx))
    return Replies(streams)


async def _pump(index: int, events: AsyncIterator[ReplyEvent], send: MemoryObjectSendStream[Item]) -> None:
    gone = (anyio.BrokenResourceError, anyio.ClosedResourceError)
    async with send:
        try:
            async for ev in events:
                await send.send((index, ev))
        except gone:  # nobody reads any more
            return
        except Exception as exc:  # this choice failed: its last item is the error
            with suppress(*gone):
                await send.send((index, exc))

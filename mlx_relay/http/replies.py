"""A request's replies as one stream of `(choice index, event)`: the one pump of every route.

Chat and completions may ask for n > 1 choices; Anthropic Messages and Responses have one; all
take this path. The request holds n admission slots, granted together (two requests holding
part of what each needs could otherwise wait on each other forever); each choice is its own
`ChatService.reply` and engine row, so the choices decode together in the batch. Every reply is
entered before the HTTP response starts, so a refusal is a clean 4xx/429. A pump task per reply
forwards its events into one bounded memory stream; an error ends that choice with the exception
as its last item. The replies live in the response's exit stack, the pumps in `Replies.run`
(the response's feeder task), cancelled before the stack closes (response done, client gone),
which then ends the generations.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, suppress

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from mlx_relay.chat.output import ReplyEvent
from mlx_relay.errors import InvalidRequest
from mlx_relay.service import ChatRequest, ChatService, ReplyTally

Item = tuple[int, ReplyEvent | Exception]
MAX_N = 16  # choices per request (the one check of `n`; Admission also bounds it by --max-num-seqs)


def choice_requests(req: ChatRequest, n: int) -> list[ChatRequest]:
    """The n choices: with a seed, choice i samples with seed + i (reproducible and distinct)."""
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    if n == 1:
        return [req]
    return [req if req.seed is None else msgspec.structs.replace(req, seed=req.seed + i) for i in range(n)]


class Replies:
    """The merged stream (`receive`) and the pumps that feed it (`run`)."""

    def __init__(self, streams: list[AsyncIterator[ReplyEvent]]) -> None:
        self.streams = streams
        self._send, self.receive = anyio.create_memory_object_stream[Item](max_buffer_size=256)

    async def run(self) -> None:
        async with self._send, anyio.create_task_group() as tg:
            for i, events in enumerate(self.streams):
                tg.start_soon(_pump, i, events, self._send.clone())


async def open_replies(stack: AsyncExitStack, service: ChatService, reqs: list[ChatRequest],
                       rid: str, *, raw: bool = False, tallies: list[ReplyTally] | None = None) -> Replies:
    """Admit and start every choice inside `stack` (ids: `rid`, then `rid-1`, ...). One choice
    takes its slot inside `ChatService.reply`; n choices take n slots together first.
    `tallies`: one per choice, kept up to date by the replies (the request log's)."""
    tally: list[ReplyTally | None] = list(tallies) if tallies else [None] * len(reqs)
    if len(reqs) == 1:
        ctx = service.reply(reqs[0], rid, raw=raw, tally=tally[0])
        return Replies([await stack.enter_async_context(ctx)])
    admitted = await stack.enter_async_context(service.admit(rid, len(reqs)))
    streams: list[AsyncIterator[ReplyEvent]] = []
    for i, req in enumerate(reqs):
        ctx = service.reply(req, rid if i == 0 else f"{rid}-{i}", admitted=admitted, raw=raw, tally=tally[i])
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

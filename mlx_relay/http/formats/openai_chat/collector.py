"""OpenAI Chat Completions: a whole reply as one `chat.completion` (the non-streamed body), each
choice folded by the in-process API's `chat.reply.ReplyCollector`."""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream

from mlx_relay.chat.reply import ReplyCollector
from mlx_relay.http.formats.openai_chat.types import (
    ChatCompletion,
    Choice,
    ChoiceLogprobs,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    total_usage,
)
from mlx_relay.http.replies import Item
from mlx_relay.http.streaming import choice_events


async def collect_chat(items: ObjectReceiveStream[Item], n: int, rid: str, model: str,
                       want_logprobs: bool) -> ChatCompletion:
    folds = [ReplyCollector() for _ in range(n)]
    async for index, ev in choice_events(items, n):
        folds[index].feed(ev)
    choices = []
    for i, fold in enumerate(folds):
        reply = fold.reply()
        calls = [ResponseToolCall(c.id, ResponseFunctionCall(c.name, c.arguments)) for c in reply.tool_calls]
        message = ResponseMessage(
            reply.content if reply.content or not calls else None,
            "assistant",
            reasoning_content=reply.reasoning or None,
            tool_calls=calls or None,
        )
        logprobs = ChoiceLogprobs(list(reply.logprobs or ())) if want_logprobs else None
        choices.append(Choice(i, message, reply.finish_reason, logprobs))
    dones = [fold.done for fold in folds if fold.done is not None]
    return ChatCompletion(id=rid, created=int(time.time()), model=model, choices=choices, usage=total_usage(dones))

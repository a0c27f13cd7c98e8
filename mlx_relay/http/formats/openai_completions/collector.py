"""OpenAI legacy Completions: a whole reply as one `text_completion` (the non-streamed body),
each choice folded by the in-process API's `chat.reply.ReplyCollector`; with `echo`, each text
starts with its prompt."""

from __future__ import annotations

import time

from anyio.abc import ObjectReceiveStream

from mlx_relay.chat.output import ReplyDone
from mlx_relay.chat.reply import ReplyCollector
from mlx_relay.http.formats.openai_completions.types import (
    Completion,
    CompletionChoice,
    CompletionRequest,
    completion_logprobs,
    completion_usage,
)
from mlx_relay.http.replies import Item
from mlx_relay.http.streaming import choice_events
from mlx_relay.service import ChatRequest


async def collect_completion(items: ObjectReceiveStream[Item], reqs: list[ChatRequest], n: int, rid: str,
                             model: str, body: CompletionRequest) -> Completion:
    folds = [ReplyCollector() for _ in reqs]
    async for index, ev in choice_events(items, len(reqs)):
        folds[index].feed(ev)
    dones: dict[int, ReplyDone] = {i: fold.done for i, fold in enumerate(folds) if fold.done is not None}
    choices = []
    for i, (req, fold) in enumerate(zip(reqs, folds, strict=True)):
        reply = fold.reply()
        head = req.prompt if body.echo and isinstance(req.prompt, str) else ""
        logprobs = completion_logprobs(list(reply.logprobs or ()), len(head)) if body.logprobs is not None else None
        choices.append(CompletionChoice(head + reply.content, i, reply.finish_reason, logprobs))
    return Completion(rid, int(time.time()), model, choices, completion_usage(dones, n))

"""OpenAI legacy Completions (`POST /v1/completions`): raw prompts in, raw text out.

The prompt (a string, token ids, or a list of either) is tokenized as it is: no chat template,
no normalization, no reply parsing (`ChatService.reply(raw=True)`), so the text is exactly what
the model generated. Each prompt gets `n` choices, numbered prompt by prompt; all of them are
admitted together and decode in the same batch. Logprobs use this API's own shape (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob} maps, `text_offset`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream

from mlx_relay.chat.output import ContentDelta, ReplyDone, TokenLogprob
from mlx_relay.errors import InvalidRequest, RelayError
from mlx_relay.http.errors import as_relay_error, error_body
from mlx_relay.http.fanout import Item, choice_requests
from mlx_relay.http.openai_chat import MAX_N
from mlx_relay.http.openai_types import StreamOptions, Usage, usage_of
from mlx_relay.service import ChatRequest

MAX_PROMPTS = 16
_TIMEOUT = object()


class CompletionRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt: str | list[str | int | list[int]]  # text, token ids, or a list of either (checked below)
    model: str | None = None
    max_tokens: int | None = 16  # the API's own default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None  # 0..5 in OpenAI's API; we allow up to 20
    echo: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    suffix: str | None = None
    user: str | None = None
    mtp: bool | None = None
    specprefill: bool | None = None  # as in chat completions
    specprefill_keep: float | None = None
    specprefill_keep_pct: float | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    text: str
    index: int
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct, omit_defaults=True, tag_field="object", tag="text_completion"):
    # `object` is the tag: always written, though defaults are omitted
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def prompts_of(body: CompletionRequest) -> list[str | list[int]]:
    p: Any = body.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
        return list(p)
    raise InvalidRequest("prompt must be a string, a list of strings, token ids or a list of token-id lists",
                         param="prompt")


def to_requests(body: CompletionRequest) -> list[ChatRequest]:
    if body.suffix:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest("best_of must equal n (no server-side ranking)", param="best_of")
    if not 1 <= body.n <= MAX_N:
        raise InvalidRequest(f"n must be between 1 and {MAX_N}", param="n")
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise InvalidRequest("logprobs must be between 0 and 20", param="logprobs")
    prompts = prompts_of(body)
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    if body.echo and not all(isinstance(p, str) for p in prompts):
        raise InvalidRequest("echo needs text prompts", param="echo")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    out: list[ChatRequest] = []
    for prompt in prompts:
        req = ChatRequest(
            messages=[], prompt=prompt, max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=stop, logprobs=body.logprobs is not None,
            top_logprobs=body.logprobs or 0, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            mtp=body.mtp is not False, specprefill=body.specprefill,
            specprefill_keep=body.specprefill_keep if body.specprefill_keep is not None else body.specprefill_keep_pct)
        out.extend(choice_requests(req, body.n))
    return out


def _logprobs(lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    offsets, at = [], offset
    for lp in lps:
        offsets.append(at)
        at += len(lp.token)
    return CompletionLogprobs([lp.token for lp in lps], [lp.logprob for lp in lps],
                              [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps], offsets)


def completion_usage(dones: dict[int, ReplyDone], n: int) -> Usage:
    """Each prompt's tokens once (its first choice), every choice's completion."""
    first = [d for i, d in sorted(dones.items()) if i % n == 0] or list(dones.values())[:1]
    prompt = sum(d.prompt_tokens for d in first)
    completion = sum(d.completion_tokens for d in dones.values())
    usage = usage_of(first[0])
    cached = sum(d.cached_tokens for d in first)
    return msgspec.structs.replace(usage, prompt_tokens=prompt, completion_tokens=completion,
                                   total_tokens=prompt + completion,
                                   prompt_tokens_details=msgspec.structs.replace(usage.prompt_tokens_details,
                                                                                 cached_tokens=cached))


async def collect_completion(items: MemoryObjectReceiveStream[Item], reqs: list[ChatRequest], n: int, rid: str,
                             model: str, body: CompletionRequest) -> Completion:
    texts: list[list[str]] = [[] for _ in reqs]
    lps: list[list[TokenLogprob]] = [[] for _ in reqs]
    dones: dict[int, ReplyDone] = {}
    async for index, ev in items:
        if isinstance(ev, BaseException):
            raise ev
        if isinstance(ev, ContentDelta):
            texts[index].append(ev.text)
            lps[index].extend(ev.logprobs or ())
        elif isinstance(ev, ReplyDone):
            dones[index] = ev
            if len(dones) == len(reqs):
                break
    if len(dones) != len(reqs):
        raise RelayError("the generation ended without finishing")
    choices = []
    for i, req in enumerate(reqs):
        head = req.prompt if body.echo and isinstance(req.prompt, str) else ""
        logprobs = _logprobs(lps[i], len(head)) if body.logprobs is not None else None
        choices.append(CompletionChoice(head + "".join(texts[i]), i, dones[i].finish_reason, logprobs))
    return Completion(rid, int(time.time()), model, choices, completion_usage(dones, n))


async def stream_completion(items: MemoryObjectReceiveStream[Item], reqs: list[ChatRequest], n: int, rid: str,
                            model: str, body: CompletionRequest, keepalive_s: float) -> AsyncIterator[bytes]:
    created = int(time.time())
    encode = msgspec.json.encode

    def frame(choice: CompletionChoice) -> bytes:
        return b"data: " + encode(Completion(rid, created, model, [choice])) + b"\n\n"

    offsets = [0] * len(reqs)
    if body.echo:
        for i, req in enumerate(reqs):
            assert isinstance(req.prompt, str)
            offsets[i] = len(req.prompt)
            yield frame(CompletionChoice(req.prompt, i, None))
    dones: dict[int, ReplyDone] = {}
    while len(dones) < len(reqs):
        item: object = _TIMEOUT
        with anyio.move_on_after(keepalive_s):
            item = await anext(aiter(items), None)
        if item is _TIMEOUT:
            yield b": keep-alive\n\n"
            continue
        if item is None:
            break
        index, ev = item  # type: ignore[misc]
        if isinstance(ev, BaseException):
            yield b"data: " + error_body(as_relay_error(ev)) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        if isinstance(ev, ContentDelta):
            logprobs = _logprobs(list(ev.logprobs or ()), offsets[index]) if body.logprobs is not None else None
            offsets[index] += len(ev.text)
            yield frame(CompletionChoice(ev.text, index, None, logprobs))
        elif isinstance(ev, ReplyDone):
            dones[index] = ev
            yield frame(CompletionChoice("", index, ev.finish_reason))
    if body.stream_options and body.stream_options.include_usage and dones:
        yield b"data: " + encode(Completion(rid, created, model, [], completion_usage(dones, n))) + b"\n\n"
    yield b"data: [DONE]\n\n"

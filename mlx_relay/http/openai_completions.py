"""OpenAI legacy Completions (`POST /v1/completions`): raw prompts in, raw text out.

The prompt (a string, token ids, or a list of either) is tokenized as it is: no chat template,
no normalization, no reply parsing (`ChatService.reply(raw=True)`), so the text is exactly what
the model generated. Each prompt gets `n` choices, numbered prompt by prompt; all of them are
admitted together and decode in the same batch. Logprobs use this API's own shape (`tokens`,
`token_logprobs`, `top_logprobs` as {token: logprob} maps, `text_offset`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from anyio.abc import ObjectReceiveStream

from mlx_relay.chat.output import ContentDelta, ReplyDone, ReplyEvent, TokenLogprob
from mlx_relay.errors import InvalidRequest, RelayError
from mlx_relay.http.errors import as_relay_error, error_body
from mlx_relay.http.openai_chat import DONE
from mlx_relay.http.openai_types import StreamOptions, Usage, usage_of
from mlx_relay.http.replies import Item, choice_requests
from mlx_relay.service import ChatRequest

MAX_PROMPTS = 16


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
    specprefill_anchor_ngram: int | None = None


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
            specprefill_keep=body.specprefill_keep if body.specprefill_keep is not None else body.specprefill_keep_pct,
            specprefill_anchor_ngram=body.specprefill_anchor_ngram)
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


async def collect_completion(items: ObjectReceiveStream[Item], reqs: list[ChatRequest], n: int, rid: str,
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


class CompletionStream:
    """`text_completion` frames (`streaming.SSEEncoder`): the echoed prompts, text deltas with
    their logprobs, a finish frame per choice, the usage frame when asked for, `[DONE]`; a
    failure is an error frame and `[DONE]` (the choices still open get no finish frame)."""

    def __init__(self, reqs: list[ChatRequest], n: int, rid: str, model: str, body: CompletionRequest) -> None:
        self.reqs, self.n, self.rid, self.model, self.body = reqs, n, rid, model, body
        self.created = int(time.time())
        self.offsets = [0] * len(reqs)
        self.dones: dict[int, ReplyDone] = {}

    @property
    def done(self) -> bool:
        return len(self.dones) == len(self.reqs)

    def _frame(self, completion: Completion) -> bytes:
        return b"data: " + msgspec.json.encode(completion) + b"\n\n"

    def _choice(self, choice: CompletionChoice) -> bytes:
        return self._frame(Completion(self.rid, self.created, self.model, [choice]))

    def start(self) -> list[bytes]:
        if not self.body.echo:
            return []
        frames = []
        for i, req in enumerate(self.reqs):
            assert isinstance(req.prompt, str)
            self.offsets[i] = len(req.prompt)
            frames.append(self._choice(CompletionChoice(req.prompt, i, None)))
        return frames

    def event(self, index: int, ev: ReplyEvent) -> list[bytes]:
        if isinstance(ev, ContentDelta):
            logprobs = None
            if self.body.logprobs is not None:
                logprobs = _logprobs(list(ev.logprobs or ()), self.offsets[index])
            self.offsets[index] += len(ev.text)
            return [self._choice(CompletionChoice(ev.text, index, None, logprobs))]
        if isinstance(ev, ReplyDone):
            self.dones[index] = ev
            return [self._choice(CompletionChoice("", index, ev.finish_reason))]
        return []

    def failed(self, exc: Exception) -> list[bytes]:
        """The error frame says why and `[DONE]` ends the stream; a choice still open gets no
        finish frame (it did not finish: no "length" may claim it did)."""
        return [b"data: " + error_body(as_relay_error(exc)) + b"\n\n", DONE]

    def end(self) -> list[bytes]:
        usage = []
        if self.body.stream_options and self.body.stream_options.include_usage and self.dones:
            usage = [self._frame(Completion(self.rid, self.created, self.model, [],
                                            completion_usage(self.dones, self.n)))]
        return [*usage, DONE]

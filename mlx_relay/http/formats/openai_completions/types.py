"""OpenAI legacy Completions wire types (msgspec), and their values from reply facts (usage,
this API's own logprobs shape: `tokens`, `token_logprobs`, `top_logprobs` as {token: logprob}
maps, `text_offset`). The usage object is Chat Completions' (`formats/openai_chat/types.py`)."""

from __future__ import annotations

import msgspec

from mlx_relay.chat.output import ReplyDone, TokenLogprob
from mlx_relay.http.formats.openai_chat.types import StreamOptions, Usage, usage_of
from mlx_relay.http.formats.speculation import SpeculationField, speculation_usage


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
    speculation: SpeculationField = None  # as in chat completions
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


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    offsets, at = [], offset
    for lp in lps:
        offsets.append(at)
        at += len(lp.token)
    return CompletionLogprobs([lp.token for lp in lps], [lp.logprob for lp in lps],
                              [{t.token: t.logprob for t in lp.top_logprobs} for lp in lps], offsets)


def completion_usage(dones: dict[int, ReplyDone], n: int) -> Usage:
    """Each prompt's tokens once (its first choice), every choice's completion and drafts."""
    first = [d for i, d in sorted(dones.items()) if i % n == 0] or list(dones.values())[:1]
    prompt = sum(d.prompt_tokens for d in first)
    completion = sum(d.completion_tokens for d in dones.values())
    usage = usage_of(first[0])
    cached = sum(d.cached_tokens for d in first)
    return msgspec.structs.replace(usage, prompt_tokens=prompt, completion_tokens=completion,
                                   total_tokens=prompt + completion, speculation=speculation_usage(dones.values()),
                                   prompt_tokens_details=msgspec.structs.replace(usage.prompt_tokens_details,
                                                                                 cached_tokens=cached))

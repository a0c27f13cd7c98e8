"""OpenAI Chat Completions wire types (msgspec): request bodies decode straight into these,
responses and stream chunks encode from them. `Usage` (and `usage_of`, `StreamOptions`) is
OpenAI's usage object, which legacy completions (`formats/openai_completions/`) share."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlx_relay.chat.output import ReplyDone, TokenLogprob
from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.http.formats.speculation import SpeculationField, SpeculationUsage, speculation_usage
from mlx_relay.specprefill.report import SpecPrefillReport


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class ChatCompletionRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    messages: list[ChatMessage]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoiceWire | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormatWire | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # extension (vLLM's name)
    reasoning_effort: str | None = None  # "none" / "minimal" turn thinking off, any other value on
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    thinking_budget: int | None = None  # extension: at most this many thinking tokens
    user: str | None = None
    mtp: bool | None = None  # mlx-relay extension: false turns MTP speculative decoding off for this request
    # mlx-relay extension: {"method": ..., "max_draft_tokens": ...}, where the drafts come from (`speculation.py`)
    speculation: SpeculationField = None
    # mlx-relay extension: SpecPrefill on / off for this request (None: the server's threshold) and
    # its keep fraction (`specprefill_keep_pct` is vllm-mlx's name for the same fraction), and the
    # anchor rule's n-gram length (0: no anchors; None: the server's)
    specprefill: bool | None = None
    specprefill_keep: float | None = None
    specprefill_keep_pct: float | None = None
    specprefill_anchor_ngram: int | None = None


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoiceWire(msgspec.Struct):
    function: FunctionName
    type: Literal["function"] = "function"


class JSONSchemaWire(msgspec.Struct, omit_defaults=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormatWire(msgspec.Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaWire | None = None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class MTPUsage(msgspec.Struct):
    """mlx-relay extension: MTP speculative decoding on this request."""

    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    mtp: MTPUsage | None = None  # present when the request decoded with MTP
    speculation: SpeculationUsage | None = None  # the drafts per source; present when a source drafted
    specprefill: SpecPrefillReport | None = None  # present when SpecPrefill ran or was due
    completion_tokens_details: CompletionTokensDetails | None = None  # present when the reply reasoned


def usage_of(done: ReplyDone) -> Usage:
    """One reply's usage (MTP's counts and the drafts per source when it drafted, reasoning tokens
    when it reasoned)."""
    mtp = None
    head = done.drafts.mtp
    if head.drafted:
        mtp = MTPUsage(head.drafted, head.accepted, round(head.accepted / head.drafted, 4))
    return Usage(done.prompt_tokens, done.completion_tokens, done.prompt_tokens + done.completion_tokens,
                 PromptTokensDetails(cached_tokens=done.cached_tokens), mtp=mtp,
                 speculation=speculation_usage([done]), specprefill=done.specprefill,
                 completion_tokens_details=CompletionTokensDetails(done.reasoning_tokens) if done.reasoning_tokens
                 else None)


def total_usage(dones: list[ReplyDone]) -> Usage:
    """One request's usage over its choices: the prompt once, the completions and the drafts
    per source summed (`mtp` stays the first choice's)."""
    usage = usage_of(dones[0])
    if len(dones) > 1:
        completion = sum(d.completion_tokens for d in dones)
        reasoning = sum(d.reasoning_tokens for d in dones)
        usage = msgspec.structs.replace(usage, completion_tokens=completion,
                                        total_tokens=usage.prompt_tokens + completion,
                                        speculation=speculation_usage(dones),
                                        completion_tokens_details=CompletionTokensDetails(reasoning) if reasoning
                                        else None)
    return usage


class ResponseFunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ResponseToolCall(msgspec.Struct):
    id: str
    function: ResponseFunctionCall
    type: Literal["function"] = "function"


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    content: str | None
    role: Literal["assistant"]  # no default: omit_defaults would leave it out
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None


class Choice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunction(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A streamed tool call: the first chunk of a call has `id`, `type` and `function.name` (and
    empty arguments), later chunks only `index` and argument fragments."""

    index: int
    function: DeltaFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True, tag_field="object", tag="chat.completion.chunk"):
    # `object` is the tag, so it is always written even though defaults are omitted.
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None

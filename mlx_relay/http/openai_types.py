"""OpenAI Chat Completions wire types (msgspec): request bodies decode straight into these,
responses and stream chunks encode from them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlx_relay.chat.output import ReplyDone, TokenLogprob
from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.messages.gpu import Finished
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
    specprefill: SpecPrefillReport | None = None  # present when SpecPrefill ran or was due
    completion_tokens_details: CompletionTokensDetails | None = None  # present when the reply reasoned


def usage_of(finished: Finished | ReplyDone) -> Usage:
    mtp = None
    if finished.mtp_drafted:
        rate = round(finished.mtp_accepted / finished.mtp_drafted, 4)
        mtp = MTPUsage(finished.mtp_drafted, finished.mtp_accepted, rate)
    reasoning = finished.reasoning_tokens if isinstance(finished, ReplyDone) else 0
    return Usage(finished.prompt_tokens, finished.completion_tokens,
                 finished.prompt_tokens + finished.completion_tokens,
                 PromptTokensDetails(cached_tokens=finished.cached_tokens), mtp, finished.specprefill,
                 CompletionTokensDetails(reasoning) if reasoning else None)


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


class ModelCapabilities(msgspec.Struct, frozen=True):
    """What the served model takes and does (a router picks a backend by these)."""

    vision: bool  # image and video inputs
    tools: bool  # tool calls (the chat template teaches a tool-call syntax the replies are parsed for)
    reasoning: bool  # thinking blocks, returned as reasoning apart from the content


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlx-relay"
    object: Literal["model"] = "model"
    context_length: int | None = None  # prompt and reply together, in tokens (None: still loading)
    max_model_len: int | None = None  # the same, by vLLM's name
    capabilities: ModelCapabilities | None = None  # None: still loading


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class HealthBody(msgspec.Struct, omit_defaults=True):
    """`GET /health`: 200 only when ready; what a load balancer needs to route by in every state."""

    status: Literal["loading", "warming", "ready", "degraded", "draining", "failed"]
    model: str
    backend: str | None = None
    running: int | None = None  # requests holding a slot
    queued: int | None = None  # requests waiting for one
    max_num_seqs: int | None = None  # slots (sequences decoded at once)
    max_queue: int | None = None  # waiting requests beyond which new ones get 429
    down: dict[str, str] | None = None  # actors not running now: name -> restarting / failed
    error: str | None = None  # why the server failed


class FlushBody(msgspec.Struct):
    """`POST /v1/cache/flush`."""

    flushed_entries: int
    flushed_bytes: int


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail

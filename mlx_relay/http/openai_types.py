"""OpenAI Chat Completions wire types (msgspec): request bodies decode straight into these,
responses and stream chunks encode from them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.engine.messages import Finished


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
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None
    mtp: bool | None = None  # mlx-relay extension: false turns MTP speculative decoding off for this request


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class MTPUsage(msgspec.Struct):
    """mlx-relay extension: MTP speculative decoding on this request."""

    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    mtp: MTPUsage | None = None  # present when the request decoded with MTP


def usage_of(finished: Finished) -> Usage:
    mtp = None
    if finished.mtp_drafted:
        rate = round(finished.mtp_accepted / finished.mtp_drafted, 4)
        mtp = MTPUsage(finished.mtp_drafted, finished.mtp_accepted, rate)
    return Usage(finished.prompt_tokens, finished.completion_tokens,
                 finished.prompt_tokens + finished.completion_tokens,
                 PromptTokensDetails(cached_tokens=finished.cached_tokens), mtp)


class ResponseMessage(msgspec.Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"


class Choice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True, tag_field="object", tag="chat.completion.chunk"):
    # `object` is the tag, so it is always written even though defaults are omitted.
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlx-relay"
    object: Literal["model"] = "model"
    context_length: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail

"""OpenAI Chat Completions: the wire request (`types.ChatCompletionRequest`) into the
front-end-neutral `ChatRequest` (its n choices: `replies.choice_requests`)."""

from __future__ import annotations

from mlx_relay.chat.types import NamedToolChoice, ResponseFormat, ToolChoice
from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.openai_chat.types import ChatCompletionRequest, ResponseFormatWire
from mlx_relay.http.formats.speculation import speculation_of
from mlx_relay.service import ChatRequest


def tool_choice_of(wire: object) -> ToolChoice:
    if wire is None:
        return "auto"
    if isinstance(wire, str):
        return wire  # type: ignore[return-value]  # the wire type admits only the three literals
    return NamedToolChoice(wire.function.name)  # type: ignore[attr-defined]


def response_format_of(wire: ResponseFormatWire | None) -> ResponseFormat | None:
    if wire is None or wire.type == "text":
        return None
    if wire.type == "json_schema":
        if wire.json_schema is None or wire.json_schema.schema is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema", param="response_format")
        return ResponseFormat("json_schema", wire.json_schema.schema, wire.json_schema.name, wire.json_schema.strict)
    return ResponseFormat("json_object")


def thinking_of(body: ChatCompletionRequest) -> bool | None:
    if body.reasoning_effort is None:
        return None
    return body.reasoning_effort not in ("none", "minimal")


def to_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    if not body.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    choice = tool_choice_of(body.tool_choice)
    if choice != "auto" and choice != "none" and not body.tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stop: tuple[str, ...] = ()
    if isinstance(body.stop, str):
        stop = (body.stop,)
    elif body.stop:
        stop = tuple(body.stop)
    speculation = speculation_of(body.speculation)
    return ChatRequest(
        messages=body.messages,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=stop,
        tools=body.tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format_of(body.response_format),
        template_kwargs=body.chat_template_kwargs or {},
        enable_thinking=thinking_of(body),
        thinking_budget=body.thinking_budget,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        mtp=body.mtp is not False,
        speculation=speculation.method,
        max_draft_tokens=speculation.max_draft_tokens,
        specprefill=body.specprefill,
        specprefill_keep=body.specprefill_keep if body.specprefill_keep is not None else body.specprefill_keep_pct,
        specprefill_anchor_ngram=body.specprefill_anchor_ngram,
    )

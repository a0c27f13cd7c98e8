"""OpenAI Responses API wire types (msgspec): the request body, its input items, the response
object, its output items and the streaming events, shaped after the `openai` SDK's
`openai.types.responses` models.

Request-side structs ignore unknown fields (clients such as Codex send many we do not use).
Input items and content parts are decoded by hand from plain dicts (`responses_routes`) rather
than as tagged unions: a message item may come without `type`, and an unsupported type must be a
400 that names it, not a schema error. Output items and stream events are tagged by `type`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlx_relay.specprefill.report import SpecPrefillReport

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]

# --------------------------------------------------------------------------------------------
# Request
# --------------------------------------------------------------------------------------------


class ReasoningConfig(msgspec.Struct, omit_defaults=True):
    """`reasoning`: effort "none"/"minimal" turns thinking off, any other effort turns it on."""

    effort: str | None = None
    summary: str | None = None


class TextFormat(msgspec.Struct, omit_defaults=True):
    """`text.format`: plain text, any JSON object, or JSON fitting `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses`. `input` items, `tools` and `tool_choice` stay loosely typed here and
    are checked in `responses_routes` (clear 400s naming what is unsupported)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = []
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    specprefill: bool | None = None  # mlx-relay extension (the SDK's extra_body), as in chat completions
    specprefill_keep: float | None = None
    specprefill_anchor_ngram: int | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    """A flat function tool (`{"type": "function", "name": ...}`); echoed back in the response."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    type: Literal["function"] = "function"


class FunctionToolChoice(msgspec.Struct):
    name: str
    type: Literal["function"] = "function"
    namespace: str | msgspec.UnsetType = msgspec.UNSET  # a namespaced tool (the name is the inner one)


# Input items (converted from dicts one by one; unknown fields ignored)


class MessageItem(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]] = ""
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    call_id: str
    name: str
    namespace: str | None = None  # a namespaced tool's call (the name is the inner one)
    arguments: str = "{}"
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    output: str | list[dict[str, Any]]
    call_id: str | None = None
    id: str | None = None
    status: str | None = None


class TextOnly(msgspec.Struct):
    """A summary_text / reasoning_text part."""

    text: str


class ReasoningItem(msgspec.Struct, kw_only=True):
    id: str | None = None
    summary: list[TextOnly] = []
    content: list[TextOnly] | None = None
    encrypted_content: str | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


# Input content parts


class InputTextPart(msgspec.Struct):
    """input_text and output_text parts."""

    text: str


class RefusalPart(msgspec.Struct):
    refusal: str


class InputImagePart(msgspec.Struct, kw_only=True):
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


# --------------------------------------------------------------------------------------------
# Response
# --------------------------------------------------------------------------------------------


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


class OutputMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: ItemStatus
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class OutputReasoning(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[Any]
    content: list[ReasoningText]


class OutputFunctionCall(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str  # always a JSON object's text
    status: ItemStatus
    # the tool's namespace when it came in one (Codex's MCP tools); the name is then the inner one
    namespace: str | msgspec.UnsetType = msgspec.UNSET


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall
ContentPart = OutputText | ReasoningText


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    # mlx-relay extension: present only when SpecPrefill ran or was due (UNSET: left out)
    specprefill: SpecPrefillReport | msgspec.UnsetType = msgspec.UNSET


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response object (`Response` in the SDK): every field the SDK declares required, and the
    request's settings echoed back."""

    id: str
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: str | FunctionToolChoice
    tools: list[FunctionTool]
    text: TextConfig
    store: bool
    object: Literal["response"] = "response"
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    prompt_cache_key: str | None = None
    truncation: str = "disabled"
    background: bool = False
    service_tier: str = "default"


class DeletedResponse(msgspec.Struct):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# --------------------------------------------------------------------------------------------
# Stream events (`event: <type>` / `data: <json>`; sequence_number set when emitted)
# --------------------------------------------------------------------------------------------


class _Event(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0


class ResponseCreated(_Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(_Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(_Event, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(_Event, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(_Event, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class ContentPartDone(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class OutputTextDelta(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ReasoningTextDelta(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str | None = None


StreamEvent = (
    ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | ResponseFailed
    | OutputItemAdded | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta | OutputTextDone
    | ReasoningTextDelta | ReasoningTextDone | FunctionCallArgumentsDelta | FunctionCallArgumentsDone
)


def event_name(ev: StreamEvent) -> str:
    """The event's `type` (its SSE `event:` name)."""
    tag = type(ev).__struct_config__.tag
    assert isinstance(tag, str)
    return tag

"""OpenAI Responses API wire types (msgspec): the request body, its input items, the response
object and its output items, shaped after the `openai` SDK's `openai.types.responses` models
(the stream events: `events.py`).

Request-side structs ignore unknown fields (clients such as Codex send many we do not use).
Input items, content parts and tools are decoded by hand from plain dicts (`request.py`,
`tools.py`, through `convert` and `type_of` here) rather than as tagged unions: a message item
may come without `type`, and an unsupported type must be a 400 that names it, not a schema
error. Output items are tagged by `type`.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

import msgspec

from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.speculation import SpeculationField, SpeculationUsage
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
    are checked in `request.py` and `tools.py` (clear 400s naming what is unsupported)."""

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
    speculation: SpeculationField = None  # mlx-relay extension, as in chat completions


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
    # mlx-relay extensions: the drafts per source, present only when a source drafted; SpecPrefill's
    # report, present only when SpecPrefill ran or was due (UNSET: left out)
    speculation: SpeculationUsage | msgspec.UnsetType = msgspec.UNSET
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


def new_id(prefix: str) -> str:
    """A response's or an output item's id (`resp_...`, `msg_...`, `rs_...`, `fc_...`)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def convert(raw: object, cls: type[Any], where: str) -> Any:
    """`raw` (a decoded JSON value) as `cls`; a mismatch is a 400 naming where it is."""
    try:
        return msgspec.convert(raw, type=cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{where}: {exc}", param=where) from None


def type_of(raw: dict[str, Any], where: str, default: str | None = None) -> str:
    kind = raw.get("type", default)
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type is missing or not a string", param=f"{where}.type")
    return kind

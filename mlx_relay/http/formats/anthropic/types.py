"""Anthropic Messages wire types: request bodies, the response message and stream events,
and a reply's facts in Anthropic's words (`stop_info`, `usage_of`, `signature`), which the
encoder and the collector both write.

Requests decode straight into these with msgspec. Unknown fields are ignored (clients send fields
this server has no use for, and new ones appear all the time); content blocks, image sources,
thinking configs and tool choices are tagged unions on `type`, so a block of an unknown type is a
400 naming where it is. `request.py` converts a request into a `ChatRequest`; `encoder.py` and
`collector.py` turn the reply events into the response types below.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from mlx_relay.chat.output import ReplyDone
from mlx_relay.http.formats.speculation import SpeculationField, SpeculationUsage, speculation_usage
from mlx_relay.specprefill.report import SpecPrefillReport

# -- request: content blocks ----------------------------------------------------------------------


class Base64Source(msgspec.Struct, tag="base64", tag_field="type"):
    media_type: str
    data: str


class UrlSource(msgspec.Struct, tag="url", tag_field="type"):
    url: str


class FileSource(msgspec.Struct, tag="file", tag_field="type"):
    file_id: str


class PlainTextSource(msgspec.Struct, tag="text", tag_field="type"):
    data: str
    media_type: str = "text/plain"


ImageSource = Base64Source | UrlSource | FileSource
DocumentSource = Base64Source | UrlSource | FileSource | PlainTextSource


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: ImageSource


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type", omit_defaults=True):
    source: DocumentSource
    title: str | None = None
    context: str | None = None


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any] = {}


class ToolReferenceBlock(msgspec.Struct, tag="tool_reference", tag_field="type"):
    """Tool search (in a tool_result only): loads the named tool of `tools` (see `Tool.defer_loading`)."""

    tool_name: str


ToolResultPart = TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type", omit_defaults=True):
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type", omit_defaults=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, tag="redacted_thinking", tag_field="type", omit_defaults=True):
    data: str = ""


InputBlock = (
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class InputMessage(msgspec.Struct):
    role: Literal["user", "assistant", "system"]  # Claude Code sends mid-conversation system messages
    content: str | list[InputBlock]


# -- request: tools, tool choice, thinking ----------------------------------------------------------


class Tool(msgspec.Struct, omit_defaults=True):
    """A client tool ({name, description, input_schema}). Anthropic's server tools (web search,
    code execution, ...) carry a versioned `type` and no `input_schema`: this server runs none.
    `defer_loading` (tool search): the tool is neither shown to the model nor callable until a
    `tool_reference` to it appears in a tool_result of the conversation."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    defer_loading: bool = False


class ToolChoiceAuto(msgspec.Struct, tag="auto", tag_field="type", omit_defaults=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, tag="any", tag_field="type", omit_defaults=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, tag="tool", tag_field="type", omit_defaults=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, tag="none", tag_field="type"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(msgspec.Struct, tag="enabled", tag_field="type", omit_defaults=True):
    budget_tokens: int | None = None


class ThinkingDisabled(msgspec.Struct, tag="disabled", tag_field="type"):
    pass


class ThinkingAdaptive(msgspec.Struct, tag="adaptive", tag_field="type"):
    pass


ThinkingConfig = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


# -- request bodies -----------------------------------------------------------------------------------


class CountTokensRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`POST /v1/messages/count_tokens`: a Messages request without the sampling fields."""

    messages: list[InputMessage]
    model: str | None = None
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, omit_defaults=True):
    """`POST /v1/messages`. `metadata`, `service_tier` and any other field not named here are
    accepted and ignored."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    specprefill: bool | None = None  # mlx-relay extension (the SDK's extra_body), as in chat completions
    specprefill_keep: float | None = None
    specprefill_anchor_ngram: int | None = None
    speculation: SpeculationField = None  # mlx-relay extension, as in chat completions


# -- response -----------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextOut(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingOut(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str


class ToolUseOut(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = TextOut | ThinkingOut | ToolUseOut


class Usage(msgspec.Struct):
    """`input_tokens` counts the prompt tokens that were prefilled; the ones restored from the
    prefix cache are `cache_read_input_tokens` (the sum of the three input figures is the prompt)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    # mlx-relay extensions: the drafts per source, present only when a source drafted; SpecPrefill's
    # report, present only when SpecPrefill ran or was due (UNSET: left out)
    speculation: SpeculationUsage | msgspec.UnsetType = msgspec.UNSET
    specprefill: SpecPrefillReport | msgspec.UnsetType = msgspec.UNSET


class Message(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage
    role: Literal["assistant"] = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# -- stream events (each one is an SSE frame `event: <type>`) ---------------------------------------


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: Message


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: OutputBlock


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: BlockDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    """The final figures: usage counts here are totals, and the input ones (not known yet when
    `message_start` goes out) overwrite those of `message_start`."""

    delta: StopInfo
    usage: Usage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


StreamEvent = (
    MessageStart | Ping | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop
)


# -- a reply's facts in Anthropic's words ---------------------------------------------------------


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block; clients send it back and it is not checked."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def stop_info(done: ReplyDone) -> StopInfo:
    reason: StopReason = "end_turn"
    if done.finish_reason == "length":
        reason = "max_tokens"
    elif done.finish_reason == "tool_calls":
        reason = "tool_use"
    elif done.stop_sequence is not None:
        reason = "stop_sequence"
    return StopInfo(reason, done.stop_sequence if reason == "stop_sequence" else None)


def usage_of(done: ReplyDone) -> Usage:
    speculation = speculation_usage([done])
    return Usage(
        input_tokens=done.prompt_tokens - done.cached_tokens,
        output_tokens=done.completion_tokens,
        cache_read_input_tokens=done.cached_tokens,
        speculation=speculation if speculation is not None else msgspec.UNSET,
        specprefill=done.specprefill if done.specprefill is not None else msgspec.UNSET,
    )

"""Chat message types shared by every front end (HTTP wire formats, the in-process API).

The Normalizer actor consumes these; the HTTP layer decodes request bodies straight into them
with msgspec, so a message that does not fit is a typed validation error, never a 500.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# tool-call syntaxes the reply parser and the grammars know: Qwen3-Coder / Qwen3.5 XML
# (`<function=NAME><parameter=...>`) and Hermes-style JSON inside `<tool_call>`
TOOL_FORMATS: tuple[str, ...] = ("qwen3_coder", "json")

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ImageUrl(msgspec.Struct, omit_defaults=True):
    url: str
    detail: str | None = None


class VideoUrl(msgspec.Struct, omit_defaults=True):
    url: str


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrlPart(msgspec.Struct, tag="image_url", tag_field="type"):
    # Some clients send the URL as a bare string instead of {"url": ...}.
    image_url: ImageUrl | str

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class VideoUrlPart(msgspec.Struct, tag="video_url", tag_field="type"):
    video_url: VideoUrl | str

    @property
    def url(self) -> str:
        return self.video_url if isinstance(self.video_url, str) else self.video_url.url


ContentPart = TextPart | ImageUrlPart | VideoUrlPart
MediaPart = ImageUrlPart | VideoUrlPart


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct, omit_defaults=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, omit_defaults=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedToolChoice(msgspec.Struct, frozen=True):
    """`tool_choice` naming one function: the reply must be exactly a call to it."""

    name: str


# "auto": the model may call tools; "none": it may not (tools are left out of the prompt);
# "required": at least one call (enforced by a grammar); a NamedToolChoice: that function.
ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ResponseFormat(msgspec.Struct, frozen=True, omit_defaults=True):
    """Structured output, enforced token by token (a grammar); "text" is unconstrained."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None  # json_schema only
    name: str | None = None
    strict: bool | None = None

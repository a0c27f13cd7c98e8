"""OpenAI Responses API stream events (msgspec, tagged by `type`): `event: <type>` /
`data: <json>` frames, numbered by `sequence_number` as they are sent (`encoder.py`)."""

from __future__ import annotations

from typing import Any

import msgspec

from mlx_relay.http.formats.responses.types import ContentPart, OutputItem, ResponseObject

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

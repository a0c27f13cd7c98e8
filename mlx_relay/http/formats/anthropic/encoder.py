"""Anthropic Messages: reply events as Anthropic's stream (`streaming.SSEEncoder`), the
`message_start` ... `message_stop` events with one content block open at a time; a failure after
the response started is an `error` event.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyDone,
    ReplyEvent,
    ReplyStarted,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.http.formats.anthropic.errors import ErrorBody, error_frame
from mlx_relay.http.formats.anthropic.types import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    OutputBlock,
    Ping,
    SignatureDelta,
    StreamEvent,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
    Usage,
    signature,
    stop_info,
    usage_of,
)


class StreamBlocks:
    """Turns reply events into Anthropic stream events: `message_start` and a `ping` with the first
    event, then content blocks indexed 0, 1, ... (one open at a time, a thinking block closed by a
    `signature_delta`), then `message_delta` and `message_stop` with `ReplyDone`."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.started = False
        self.index = -1
        self.open: type[OutputBlock] | None = None
        self._thinking: list[str] = []
        self._arguments = ""  # the open tool call's arguments sent so far

    def feed(self, ev: ReplyEvent) -> Iterator[StreamEvent]:
        if not self.started:
            self.started = True
            # the prompt's size is known when the generation starts (ReplyStarted comes first):
            # clients such as Claude Code account the context from message_start
            if isinstance(ev, ReplyStarted):
                usage = Usage(ev.prompt_tokens - ev.cached_tokens, 0, cache_read_input_tokens=ev.cached_tokens)
            else:
                usage = usage_of(ev) if isinstance(ev, ReplyDone) else Usage(0, 0)
            yield MessageStart(Message(self.message_id, self.model, [], None, None, usage))
            yield Ping()
        if isinstance(ev, ReasoningDelta) and ev.text:
            yield from self._open(ThinkingOut)
            self._thinking.append(ev.text)
            yield ContentBlockDelta(self.index, ThinkingDelta(ev.text))
        elif isinstance(ev, ContentDelta) and ev.text:
            yield from self._open(TextOut)
            yield ContentBlockDelta(self.index, TextDelta(ev.text))
        elif isinstance(ev, ToolCallStart):
            yield from self._close()
            yield from self._start(ToolUseOut(ev.id, ev.name, {}))
        elif isinstance(ev, ToolCallArguments) and ev.fragment and self.open is ToolUseOut:
            self._arguments += ev.fragment
            yield ContentBlockDelta(self.index, InputJsonDelta(ev.fragment))
        elif isinstance(ev, ToolCallEnd) and self.open is ToolUseOut:
            rest = ev.arguments[len(self._arguments):] if ev.arguments.startswith(self._arguments) else ""
            if rest:  # the whole object, where no (or not all) fragments came before
                yield ContentBlockDelta(self.index, InputJsonDelta(rest))
            yield from self._close()
        elif isinstance(ev, ReplyDone):
            yield from self._close()
            yield MessageDelta(stop_info(ev), usage_of(ev))
            yield MessageStop()

    def _start(self, block: OutputBlock) -> Iterator[StreamEvent]:
        self.index += 1
        self.open = type(block)
        self._thinking, self._arguments = [], ""
        yield ContentBlockStart(self.index, block)

    def _open(self, kind: type[TextOut] | type[ThinkingOut]) -> Iterator[StreamEvent]:
        if self.open is not kind:
            yield from self._close()
            yield from self._start(ThinkingOut("", "") if kind is ThinkingOut else TextOut(""))

    def _close(self) -> Iterator[StreamEvent]:
        if self.open is None:
            return
        if self.open is ThinkingOut:
            yield ContentBlockDelta(self.index, SignatureDelta(signature("".join(self._thinking))))
        yield ContentBlockStop(self.index)
        self.open = None


def sse_frame(event: StreamEvent | ErrorBody) -> bytes:
    name: str = type(event).__struct_config__.tag  # type: ignore[assignment]
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class AnthropicStream:
    """Anthropic's stream events as SSE frames (`streaming.SSEEncoder`) through `StreamBlocks`;
    a failure after the response started is an `error` event."""

    def __init__(self, message_id: str, model: str) -> None:
        self.blocks = StreamBlocks(message_id, model)
        self.done = False

    def start(self) -> list[bytes]:
        return []

    def event(self, index: int, ev: ReplyEvent) -> list[bytes]:
        self.done = isinstance(ev, ReplyDone)
        return [sse_frame(event) for event in self.blocks.feed(ev)]

    def failed(self, exc: Exception) -> list[bytes]:
        return [error_frame(exc)]

    def end(self) -> list[bytes]:
        return []

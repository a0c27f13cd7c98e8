"""Anthropic Messages: a whole reply as one `message` (the non-streamed body): its content
blocks in the order the model wrote them."""

from __future__ import annotations

import msgspec
from anyio.abc import ObjectReceiveStream

from mlx_relay.chat.output import ContentDelta, ReasoningDelta, ReplyDone, ReplyEvent, ToolCallEnd
from mlx_relay.http.formats.anthropic.types import (
    Message,
    OutputBlock,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    signature,
    stop_info,
    usage_of,
)
from mlx_relay.http.replies import Item
from mlx_relay.http.streaming import reply_events


def _tool_input(end: ToolCallEnd) -> dict[str, object]:
    """The call's arguments (always a JSON object: `chat.reply_parser`)."""
    arguments: dict[str, object] = msgspec.json.decode(end.arguments or "{}", type=dict[str, object])
    return arguments


class MessageBuilder:
    """Collects a whole reply into content blocks, in the order the model wrote them: consecutive
    reasoning is one thinking block, consecutive text one text block, each tool call a tool_use."""

    def __init__(self) -> None:
        self.blocks: list[OutputBlock] = []
        self._pieces: list[str] = []
        self.done: ReplyDone | None = None

    def feed(self, ev: ReplyEvent) -> None:
        if isinstance(ev, ReasoningDelta | ContentDelta) and ev.text:
            kind = ThinkingOut if isinstance(ev, ReasoningDelta) else TextOut
            if not self.blocks or not isinstance(self.blocks[-1], kind):
                self._seal()
                self.blocks.append(ThinkingOut("", "") if kind is ThinkingOut else TextOut(""))
            self._pieces.append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            self._seal()
            self.blocks.append(ToolUseOut(ev.id, ev.name, _tool_input(ev)))
        elif isinstance(ev, ReplyDone):
            self._seal()
            self.done = ev

    def _seal(self) -> None:
        if not self._pieces:
            return
        text, self._pieces = "".join(self._pieces), []
        last = self.blocks[-1]
        if isinstance(last, ThinkingOut):
            last.thinking, last.signature = text, signature(text)
        elif isinstance(last, TextOut):
            last.text = text


async def collect_message(items: ObjectReceiveStream[Item], message_id: str, model: str) -> Message:
    builder = MessageBuilder()
    async for ev in reply_events(items):
        builder.feed(ev)
    assert builder.done is not None  # `reply_events` ends with the reply's ReplyDone
    stop = stop_info(builder.done)
    return Message(message_id, model, builder.blocks, stop.stop_reason, stop.stop_sequence, usage_of(builder.done))

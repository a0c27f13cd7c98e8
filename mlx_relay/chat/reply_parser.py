"""ReplyParser: splits a reply's streamed text into reasoning, content and tool calls.

Runs on the event loop side of `ChatService.reply` (pure Python, no MLX), one parser per reply.
Text arrives in arbitrary pieces (an engine delta may end in the middle of a tag); the parser
holds back any tail that could still become a tag, so no `<think>`, `</think>`, `<tool_call>` or
`<function=` markup ever reaches a `ContentDelta`.
"""

from __future__ import annotations

from mlx_relay.chat.output import ContentDelta, ReasoningDelta, ReplyEvent, TokenLogprob
from mlx_relay.chat.types import ToolDef

THINK_START, THINK_END = "<think>", "</think>"


def _partial_tail(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of one of `tags`."""
    keep = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), keep, -1):
            if buf.endswith(tag[:k]):
                keep = k
                break
    return keep


class ReplyParser:
    def __init__(self, *, tools: list[ToolDef] | None = None, tool_format: str | None = "qwen3_coder",
                 think_open: bool = False) -> None:
        self.tools = tools or []
        self.tool_format = tool_format if self.tools else None
        self._thinking = think_open
        self._started = False
        self._buf = ""
        self.calls = 0

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[ReplyEvent]:
        self._buf += text
        out: list[ReplyEvent] = []
        while self._buf:
            if self._thinking:
                i = self._buf.find(THINK_END)
                if i < 0:
                    keep = _partial_tail(self._buf, (THINK_END,))
                    emit, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    if emit:
                        out.append(ReasoningDelta(emit))
                    break
                if i:
                    out.append(ReasoningDelta(self._buf[:i]))
                self._buf = self._buf[i + len(THINK_END):].lstrip("\n") if i + len(THINK_END) < len(self._buf) \
                    else ""
                self._thinking = False
                continue
            if not self._started and THINK_START.startswith(self._buf.lstrip()[:len(THINK_START)]) \
                    and len(self._buf.lstrip()) < len(THINK_START):
                break  # could still be an opening <think>
            if not self._started and self._buf.lstrip().startswith(THINK_START):
                self._buf = self._buf.lstrip()[len(THINK_START):]
                self._thinking = True
                self._started = True
                continue
            self._started = True
            keep = _partial_tail(self._buf, ())
            emit = self._buf[:len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep:]
            if emit:
                out.append(ContentDelta(emit, logprobs))
        return out

    def finish(self) -> list[ReplyEvent]:
        buf, self._buf = self._buf, ""
        if not buf:
            return []
        return [ReasoningDelta(buf)] if self._thinking else [ContentDelta(buf)]

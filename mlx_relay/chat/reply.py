"""A whole reply, collected from its events: what the in-process API's `Relay.chat` returns.

`ChatService.reply` parses the engine's text into reply events (`mlx_relay.chat.output`); every
front end folds those events into its own shape. `ReplyCollector` is the front-end-neutral fold:
the visible content, the reasoning, the tool calls (each with its arguments as a JSON object
string), the finish and the usage (cached prompt tokens and the speculative drafts' counts
included). It sees the same events the HTTP routes see, so `Relay.chat` answers what a client of
the server would get, never the model's raw text with its `<think>` and tool-call markup.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from mlx_relay.chat.output import (
    ContentDelta,
    Drafts,
    ReasoningDelta,
    ReplyDone,
    ReplyEvent,
    ReplyFinish,
    TokenLogprob,
    ToolCallEnd,
)
from mlx_relay.specprefill.report import SpecPrefillReport


class ToolCall(msgspec.Struct, frozen=True):
    """One call the model made: `arguments` is the JSON object text, as the wire formats carry it."""

    id: str
    name: str
    arguments: str

    def parsed_arguments(self) -> dict[str, Any]:
        value = json.loads(self.arguments or "{}")
        return value if isinstance(value, dict) else {}


class ReplyUsage(msgspec.Struct, frozen=True):
    """What the reply cost: prompt tokens (of which `cached_tokens` came from the prefix cache),
    generated tokens (of which `reasoning_tokens` were thinking), and the speculative drafts
    verified/accepted by source (`drafts`: the MTP head's, those copied from the context, a draft
    model's)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    drafts: Drafts = Drafts()

    @property
    def mtp_drafted(self) -> int:
        return self.drafts.mtp.drafted

    @property
    def mtp_accepted(self) -> int:
        return self.drafts.mtp.accepted

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChatReply(msgspec.Struct, frozen=True, kw_only=True):
    """One finished reply. `raw_text` and `token_ids` are what the model generated, markup and
    all (for exactness checks and for replaying a turn into the next prompt byte for byte)."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: ReplyFinish
    usage: ReplyUsage
    stop_sequence: str | None = None
    specprefill: SpecPrefillReport | None = None
    logprobs: list[TokenLogprob] | None = None
    raw_text: str = ""
    token_ids: list[int] = []

    @property
    def prompt_tokens(self) -> int:
        return self.usage.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens

    @property
    def cached_tokens(self) -> int:
        return self.usage.cached_tokens

    @property
    def drafts(self) -> Drafts:
        return self.usage.drafts

    @property
    def mtp_drafted(self) -> int:
        return self.usage.mtp_drafted

    @property
    def mtp_accepted(self) -> int:
        return self.usage.mtp_accepted


class ReplyCollector:
    """Folds one reply's events (`feed`) into a `ChatReply` (`reply`, once `ReplyDone` came)."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self._logprobs: list[TokenLogprob] = []
        self.done: ReplyDone | None = None

    def feed(self, ev: ReplyEvent) -> None:
        if isinstance(ev, ContentDelta):
            self._content.append(ev.text)
            self._logprobs.extend(ev.logprobs or ())
        elif isinstance(ev, ReasoningDelta):
            self._reasoning.append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            self._calls.append(ToolCall(ev.id, ev.name, ev.arguments or "{}"))
        elif isinstance(ev, ReplyDone):
            self.done = ev

    def reply(self, *, raw_text: str = "", token_ids: list[int] | None = None) -> ChatReply:
        done = self.done
        if done is None:
            raise RuntimeError("the reply has not finished")
        usage = ReplyUsage(done.prompt_tokens, done.completion_tokens, done.cached_tokens, done.reasoning_tokens,
                           done.drafts)
        return ChatReply(content="".join(self._content), reasoning="".join(self._reasoning),
                         tool_calls=list(self._calls), finish_reason=done.finish_reason, usage=usage,
                         stop_sequence=done.stop_sequence, specprefill=done.specprefill,
                         logprobs=self._logprobs or None, raw_text=raw_text, token_ids=token_ids or [])

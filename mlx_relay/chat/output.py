"""What a reply is made of, after parsing: the events every front end (OpenAI chat, Anthropic
Messages, Responses, the in-process API) turns into its own wire format.

The engine streams text (`TokenDelta`); `mlx_relay.chat.reply_parser.ReplyParser` splits that
text into reasoning, visible content and tool calls, and `ChatService.reply` ends the stream with
`ReplyDone`. Wire formats never look at raw model text, so no tool markup and no `<think>` block
can reach a client's `content` through any of them.

Order within one reply: `ReplyStarted` first (the prompt's size, known before the first token:
Anthropic's `message_start` reports it); `ReasoningDelta`s and `ContentDelta`s in the order the model wrote them;
each tool call as `ToolCallStart`, then one or more `ToolCallArguments` (JSON text fragments whose
concatenation is the call's arguments object), then `ToolCallEnd`; calls are numbered 0, 1, ... in
order; `ReplyDone` last.
"""

from __future__ import annotations

from typing import Literal, get_args

import msgspec

from mlx_relay.specprefill.report import SpecPrefillReport

ReplyFinish = Literal["stop", "length", "tool_calls"]
# what the model can write wrong in a tool call (`ReplyParser`'s docstring says how each is delivered)
InvalidReason = Literal["undeclared_tool", "schema_mismatch", "unreadable", "unclosed", "stray_markup"]
INVALID_REASONS: tuple[str, ...] = get_args(InvalidReason)


class TopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, frozen=True):
    """One generated token's log-probability under the model, and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob] = []


class ReplyStarted(msgspec.Struct, frozen=True):
    """The generation started: the prompt's tokens, of which `cached_tokens` are restored."""

    prompt_tokens: int
    cached_tokens: int = 0


class ReasoningDelta(msgspec.Struct, frozen=True):
    """Text inside the model's thinking block (never part of the visible content)."""

    text: str


class ContentDelta(msgspec.Struct, frozen=True):
    """Visible answer text. `logprobs`: the tokens behind the engine delta this text came from
    (present only when the request asked for logprobs)."""

    text: str
    logprobs: list[TokenLogprob] | None = None


class ToolCallStart(msgspec.Struct, frozen=True):
    """A tool call begins: its position among this reply's calls, a fresh id, the function name
    (already checked against the declared tools)."""

    index: int
    id: str
    name: str


class ToolCallArguments(msgspec.Struct, frozen=True):
    """A fragment of the call's arguments as JSON text."""

    index: int
    fragment: str


class ToolCallEnd(msgspec.Struct, frozen=True):
    """The call is complete: `arguments` is the whole JSON object, validated against the tool's
    parameter schema."""

    index: int
    id: str
    name: str
    arguments: str


class SourceDrafts(msgspec.Struct, frozen=True):
    """One draft source's verified drafts and how many were accepted."""

    drafted: int = 0
    accepted: int = 0

    def __add__(self, other: SourceDrafts) -> SourceDrafts:
        return SourceDrafts(self.drafted + other.drafted, self.accepted + other.accepted)


class Drafts(msgspec.Struct, frozen=True):
    """A request's speculative drafts by source (carried whole from the engine to the reply's
    usage): the MTP head's, those copied from its context, a draft model's."""

    mtp: SourceDrafts = SourceDrafts()
    context: SourceDrafts = SourceDrafts()
    draft: SourceDrafts = SourceDrafts()

    def __add__(self, other: Drafts) -> Drafts:
        return Drafts(self.mtp + other.mtp, self.context + other.context, self.draft + other.draft)

    def by_source(self) -> dict[str, SourceDrafts]:
        return {name: getattr(self, name) for name in self.__struct_fields__}

    @classmethod
    def of(cls, tallies: dict[str, tuple[int, int]]) -> Drafts:
        """From a lane's (drafted, accepted) per source name."""
        return cls(**{name: SourceDrafts(*tallies[name]) for name in cls.__struct_fields__ if name in tallies})


class ReplyDone(msgspec.Struct, frozen=True):
    """The reply ended. `finish_reason` is "tool_calls" when the reply made at least one call."""

    finish_reason: ReplyFinish
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    drafts: Drafts = Drafts()  # speculative decoding: drafts verified and accepted, by source
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    specprefill: SpecPrefillReport | None = None  # when SpecPrefill ran or was due


ReplyEvent = ReplyStarted | ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArguments | ToolCallEnd | ReplyDone

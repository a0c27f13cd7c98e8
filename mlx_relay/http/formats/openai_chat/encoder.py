"""OpenAI Chat Completions: reply events as a stream of `chat.completion.chunk` frames
(`streaming.SSEEncoder`).

Streams follow the spec clients check: the first chunk carries the role; reasoning streams as
`reasoning_content` deltas; each tool call's first chunk carries `index`, `id`, `type` and
`function.name` (arguments ""), later chunks `index` and argument fragments; exactly one chunk
per choice carries its `finish_reason` ("tool_calls" when the choice called tools); the usage
chunk (with `stream_options.include_usage`) and `[DONE]` come last. `DONE` and `error_frames`
end legacy completions' streams too (`formats/openai_completions/encoder.py`).
"""

from __future__ import annotations

import time

import msgspec

from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyDone,
    ReplyEvent,
    ToolCallArguments,
    ToolCallStart,
)
from mlx_relay.http.errors import as_relay_error, error_body
from mlx_relay.http.formats.openai_chat.types import (
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    total_usage,
)

DONE = b"data: [DONE]\n\n"


def error_frames(exc: BaseException) -> list[bytes]:
    """A failed OpenAI stream's end: the error frame says why (clients such as openai-python
    raise it) and `[DONE]` ends the stream."""
    return [b"data: " + error_body(as_relay_error(exc)) + b"\n\n", DONE]


def _delta_of(ev: object) -> Delta | None:
    if isinstance(ev, ContentDelta):
        return Delta(content=ev.text) if ev.text else None
    if isinstance(ev, ReasoningDelta):
        return Delta(reasoning_content=ev.text) if ev.text else None
    if isinstance(ev, ToolCallStart):
        call = DeltaToolCall(ev.index, DeltaFunction(name=ev.name, arguments=""), id=ev.id, type="function")
        return Delta(tool_calls=[call])
    if isinstance(ev, ToolCallArguments):
        return Delta(tool_calls=[DeltaToolCall(ev.index, DeltaFunction(arguments=ev.fragment))])
    return None


class ChatStream:
    """`chat.completion.chunk` frames (`streaming.SSEEncoder`): a role chunk per choice, deltas,
    a finish chunk per choice, the usage chunk when asked for, `[DONE]`; a failure is an error
    frame and `[DONE]` (the choices still open get no finish chunk)."""

    def __init__(self, n: int, rid: str, model: str, include_usage: bool, want_logprobs: bool) -> None:
        self.n, self.rid, self.model = n, rid, model
        self.include_usage, self.want_logprobs = include_usage, want_logprobs
        self.created = int(time.time())
        self.dones: list[ReplyDone] = []

    @property
    def done(self) -> bool:
        return len(self.dones) == self.n

    def _frame(self, chunk: ChatCompletionChunk) -> bytes:
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    def _choice(self, choice: ChunkChoice) -> bytes:
        return self._frame(ChatCompletionChunk(self.rid, self.created, self.model, [choice]))

    def start(self) -> list[bytes]:
        return [self._choice(ChunkChoice(i, Delta(role="assistant", content=""))) for i in range(self.n)]

    def event(self, index: int, ev: ReplyEvent) -> list[bytes]:
        if isinstance(ev, ReplyDone):
            self.dones.append(ev)
            return [self._choice(ChunkChoice(index, Delta(), ev.finish_reason))]
        delta = _delta_of(ev)
        if delta is None:
            return []
        logprobs = None
        if self.want_logprobs and isinstance(ev, ContentDelta):
            logprobs = ChoiceLogprobs(list(ev.logprobs or ()))
        return [self._choice(ChunkChoice(index, delta, None, logprobs))]

    def failed(self, exc: Exception) -> list[bytes]:
        """The error frame says why (clients such as openai-python raise it) and `[DONE]` ends the
        stream; a choice still open gets no finish chunk (it did not finish: no "length" or "stop"
        may claim it did)."""
        return error_frames(exc)

    def end(self) -> list[bytes]:
        usage = []
        if self.include_usage and self.dones:
            usage = [self._frame(ChatCompletionChunk(self.rid, self.created, self.model, [],
                                                     usage=total_usage(self.dones)))]
        return [*usage, DONE]

"""OpenAI Chat Completions: the wire request into a `ChatRequest`, reply events into a
`chat.completion` or a stream of `chat.completion.chunk`s.

Streams follow the spec clients check: the first chunk carries the role; reasoning streams as
`reasoning_content` deltas; each tool call's first chunk carries `index`, `id`, `type` and
`function.name` (arguments ""), later chunks `index` and argument fragments; exactly one chunk
per choice carries its `finish_reason` ("tool_calls" when the choice called tools); the usage
chunk (with `stream_options.include_usage`) and `[DONE]` come last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
from anyio.abc import ObjectReceiveStream

from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyDone,
    ReplyEvent,
    TokenLogprob,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.chat.types import NamedToolChoice, ResponseFormat, ToolChoice
from mlx_relay.errors import InvalidRequest, RelayError
from mlx_relay.http.errors import as_relay_error, error_body
from mlx_relay.http.openai_types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionTokensDetails,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    ResponseFormatWire,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    Usage,
    usage_of,
)
from mlx_relay.http.replies import Item
from mlx_relay.service import ChatRequest


def tool_choice_of(wire: object) -> ToolChoice:
    if wire is None:
        return "auto"
    if isinstance(wire, str):
        return wire  # type: ignore[return-value]  # the wire type admits only the three literals
    return NamedToolChoice(wire.function.name)  # type: ignore[attr-defined]


def response_format_of(wire: ResponseFormatWire | None) -> ResponseFormat | None:
    if wire is None or wire.type == "text":
        return None
    if wire.type == "json_schema":
        if wire.json_schema is None or wire.json_schema.schema is None:
            raise InvalidRequest("response_format json_schema needs json_schema.schema", param="response_format")
        return ResponseFormat("json_schema", wire.json_schema.schema, wire.json_schema.name, wire.json_schema.strict)
    return ResponseFormat("json_object")


def thinking_of(body: ChatCompletionRequest) -> bool | None:
    if body.reasoning_effort is None:
        return None
    return body.reasoning_effort not in ("none", "minimal")


def to_chat_request(body: ChatCompletionRequest) -> ChatRequest:
    if not body.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    choice = tool_choice_of(body.tool_choice)
    if choice != "auto" and choice != "none" and not body.tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    stop: tuple[str, ...] = ()
    if isinstance(body.stop, str):
        stop = (body.stop,)
    elif body.stop:
        stop = tuple(body.stop)
    return ChatRequest(
        messages=body.messages,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        stop=stop,
        tools=body.tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format_of(body.response_format),
        template_kwargs=body.chat_template_kwargs or {},
        enable_thinking=thinking_of(body),
        thinking_budget=body.thinking_budget,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        mtp=body.mtp is not False,
        specprefill=body.specprefill,
        specprefill_keep=body.specprefill_keep if body.specprefill_keep is not None else body.specprefill_keep_pct,
        specprefill_anchor_ngram=body.specprefill_anchor_ngram,
    )


def total_usage(dones: list[ReplyDone]) -> Usage:
    """One request's usage over its choices: the prompt once, the completions summed."""
    usage = usage_of(dones[0])
    if len(dones) > 1:
        completion = sum(d.completion_tokens for d in dones)
        reasoning = sum(d.reasoning_tokens for d in dones)
        usage = msgspec.structs.replace(usage, completion_tokens=completion,
                                        total_tokens=usage.prompt_tokens + completion,
                                        completion_tokens_details=CompletionTokensDetails(reasoning) if reasoning
                                        else None)
    return usage


@dataclass
class _ChoiceState:
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ResponseToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    done: ReplyDone | None = None


async def collect_chat(items: ObjectReceiveStream[Item], n: int, rid: str, model: str,
                       want_logprobs: bool) -> ChatCompletion:
    states = [_ChoiceState() for _ in range(n)]
    async for index, ev in items:
        st = states[index]
        if isinstance(ev, BaseException):
            raise ev
        if isinstance(ev, ContentDelta):
            st.content.append(ev.text)
            st.logprobs.extend(ev.logprobs or ())
        elif isinstance(ev, ReasoningDelta):
            st.reasoning.append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            st.calls.append(ResponseToolCall(ev.id, ResponseFunctionCall(ev.name, ev.arguments or "{}")))
        elif isinstance(ev, ReplyDone):
            st.done = ev
            if all(s.done is not None for s in states):
                break
    if any(s.done is None for s in states):
        raise RelayError("the generation ended without finishing")
    choices = []
    for i, st in enumerate(states):
        assert st.done is not None
        message = ResponseMessage(
            "".join(st.content) if st.content or not st.calls else None,
            "assistant",
            reasoning_content="".join(st.reasoning) if st.reasoning else None,
            tool_calls=st.calls or None,
        )
        logprobs = ChoiceLogprobs(st.logprobs) if want_logprobs else None
        choices.append(Choice(i, message, st.done.finish_reason, logprobs))
    dones = [s.done for s in states if s.done is not None]
    return ChatCompletion(id=rid, created=int(time.time()), model=model, choices=choices, usage=total_usage(dones))


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
        return [b"data: " + error_body(as_relay_error(exc)) + b"\n\n", DONE]

    def end(self) -> list[bytes]:
        usage = []
        if self.include_usage and self.dones:
            usage = [self._frame(ChatCompletionChunk(self.rid, self.created, self.model, [],
                                                     usage=total_usage(self.dones)))]
        return [*usage, DONE]


DONE = b"data: [DONE]\n\n"

"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) over `ChatService.reply`.

Translates an Anthropic Messages request into the front-end-neutral `ChatRequest` (system blocks,
text / image / document / tool_use / tool_result / thinking blocks, tools, tool_choice, thinking)
and the parsed reply events (`mlx_relay.chat.output`) into Anthropic's wire format: one `message`
object, or the `message_start` ... `message_stop` event stream with one content block open at a
time. Every error on these routes is rendered in Anthropic's error shape, never OpenAI's.

As on the OpenAI route, everything that can refuse a request happens before the response starts,
and the generation belongs to the response: a client that goes away cancels it. A streamed reply
is read by a task of the response's own, so keep-alive timeouts never cancel the reply itself.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import msgspec
from anyio.abc import ObjectReceiveStream
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

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
from mlx_relay.chat.types import (
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDef,
    ImageUrl,
    ImageUrlPart,
    NamedToolChoice,
    TextPart,
    ToolCall,
    ToolDef,
)
from mlx_relay.config import ServerConfig
from mlx_relay.errors import (
    InvalidRequest,
    MaxTokensExceedContext,
    NotFound,
    NotReady,
    Overloaded,
    PromptTooLong,
    RelayError,
    Unauthorized,
    UnprocessableRequest,
)
from mlx_relay.http.anthropic_types import (
    Base64Source,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DocumentBlock,
    ErrorBody,
    ErrorDetail,
    ErrorType,
    ImageBlock,
    InputBlock,
    InputJsonDelta,
    InputMessage,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputBlock,
    Ping,
    PlainTextSource,
    RedactedThinkingBlock,
    SignatureDelta,
    StopInfo,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDisabled,
    ThinkingEnabled,
    ThinkingOut,
    TokenCount,
    Tool,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolResultPart,
    ToolUseBlock,
    ToolUseOut,
    UrlSource,
    Usage,
)
from mlx_relay.http.body import decode_body
from mlx_relay.http.errors import ErrorResponse, as_relay_error
from mlx_relay.http.replies import Item
from mlx_relay.http.streaming import events_of, respond
from mlx_relay.service import ChatRequest, ChatService

JSON = "application/json"
_ERROR_PREFIX = "Error: "  # a tool_result with is_error: true reaches the model as this + its text

Handler = Callable[[Request], Awaitable[Response]]
BodyT = TypeVar("BodyT", MessagesRequest, CountTokensRequest)


# -- errors ---------------------------------------------------------------------------------------


def _error_type(err: RelayError) -> ErrorType:
    if isinstance(err, Unauthorized):
        return "authentication_error"
    if isinstance(err, NotFound):
        return "not_found_error"
    if isinstance(err, Overloaded):
        return "rate_limit_error"
    if isinstance(err, NotReady):
        return "overloaded_error"
    if isinstance(err, InvalidRequest | UnprocessableRequest) or 400 <= err.status < 500:
        return "invalid_request_error"
    return "api_error"


def _as_error(exc: BaseException) -> RelayError:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return as_relay_error(exc)


def _message(err: RelayError) -> str:
    """The error's message in Anthropic's words where clients parse them: Claude Code reads the
    numbers of both context overflows (to lower max_tokens and retry, or to compact)."""
    if isinstance(err, MaxTokensExceedContext):
        return (f"input length and `max_tokens` exceed context limit: {err.prompt_tokens} + {err.max_tokens} > "
                f"{err.context_length}, decrease input length or `max_tokens` and try again")
    if isinstance(err, PromptTooLong):
        return f"prompt is too long: {err.prompt_tokens} tokens > {err.limit} maximum"
    return err.message


def error_body(err: RelayError) -> bytes:
    return msgspec.json.encode(ErrorBody(ErrorDetail(_error_type(err), _message(err))))


def error_response(exc: BaseException) -> Response:
    """Any failure as Anthropic's `{"type": "error", "error": {...}}`, with Retry-After where the
    error says when to come back."""
    err = _as_error(exc)
    return ErrorResponse(err, error_body(err), err.status if 400 <= err.status < 600 else 500)


def _anthropic_errors(handler: Handler) -> Handler:
    """The app's global handlers answer in the OpenAI shape; these routes catch their own."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return error_response(exc)

    return wrapped


def _decode(raw: bytes, body_type: type[BodyT], max_depth: int) -> BodyT:
    """A body that is not JSON or does not fit the schema is a 400 (`invalid_request_error`)."""
    try:
        return decode_body(raw, body_type, max_depth)
    except UnprocessableRequest as err:
        raise InvalidRequest(err.message, param=err.param) from None


# -- request: Anthropic -> ChatRequest --------------------------------------------------------------


def _image_url(block: ImageBlock, where: str) -> ImageUrlPart:
    source = block.source
    if isinstance(source, Base64Source):
        return ImageUrlPart(ImageUrl(f"data:{source.media_type};base64,{source.data}"))
    if isinstance(source, UrlSource):
        return ImageUrlPart(ImageUrl(source.url))
    raise InvalidRequest("file sources (the Files API) are not supported: send base64 or a URL", param=where)


def _document_text(block: DocumentBlock, where: str) -> TextPart:
    if not isinstance(block.source, PlainTextSource):
        raise InvalidRequest("only plain-text documents are supported", param=where)
    heading = "\n".join(s for s in (block.title, block.context) if s)
    return TextPart(f"{heading}\n\n{block.source.data}" if heading else block.source.data)


def _part(block: ToolResultPart, where: str) -> ContentPart:
    if isinstance(block, TextBlock):
        return TextPart(block.text)
    if isinstance(block, ImageBlock):
        return _image_url(block, where)
    return _document_text(block, where)


def _content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Text-only parts collapse to a string (as the normalizer would: joined with "")."""
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, TextPart))
    return parts


def _tool_result(block: ToolResultBlock, names: dict[str, str], where: str) -> ChatMessage:
    if block.content is None or isinstance(block.content, str):
        parts: list[ContentPart] = [TextPart(block.content or "")]
    else:
        parts = [_part(b, f"{where}.content[{k}]") for k, b in enumerate(block.content)]
    if block.is_error:
        parts.insert(0, TextPart(_ERROR_PREFIX))
    return ChatMessage(role="tool", content=_content(parts), tool_call_id=block.tool_use_id,
                       name=names.get(block.tool_use_id))


def _user_messages(blocks: list[InputBlock], names: dict[str, str], where: str) -> list[ChatMessage]:
    """One `tool` message per tool_result, the other blocks as user turns between them (in order)."""
    out: list[ChatMessage] = []
    pending: list[ContentPart] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, ToolResultBlock):
            if pending:
                out.append(ChatMessage(role="user", content=_content(pending)))
                pending = []
            out.append(_tool_result(block, names, at))
        elif isinstance(block, TextBlock | ImageBlock | DocumentBlock):
            pending.append(_part(block, at))
        else:
            raise InvalidRequest(f"a {type(block).__struct_config__.tag} block belongs in an assistant message",
                                 param=at)
    if pending:
        out.append(ChatMessage(role="user", content=_content(pending)))
    return out


def _assistant_message(blocks: list[InputBlock], names: dict[str, str], where: str) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if block.thinking:
                thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            names[block.id] = block.name
            arguments = msgspec.json.encode(block.input).decode()
            calls.append(ToolCall(id=block.id, function=FunctionCall(block.name, arguments)))
        elif not isinstance(block, RedactedThinkingBlock):  # redacted thinking is opaque: dropped
            raise InvalidRequest(f"a {type(block).__struct_config__.tag} block belongs in a user message",
                                 param=f"{where}.content[{j}]")
    return ChatMessage(
        role="assistant",
        content="".join(texts) if texts or not calls else None,
        tool_calls=calls or None,
        reasoning_content="\n\n".join(thoughts) if thoughts else None,
    )


# Claude Code's first system block carries a per-request nonce ("...; cch=<nonce>;"); kept, it
# would make every prompt's prefix new and defeat the prefix cache (vllm-mlx #522)
_BILLING_HEADER = "x-anthropic-billing-header:"


def _system_message(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    else:
        text = "\n\n".join(b.text for b in system if not b.text.lstrip().startswith(_BILLING_HEADER))
    return [ChatMessage(role="system", content=text)] if text else []


def _system_text(content: str | list[InputBlock]) -> str:
    if isinstance(content, str):
        return content
    return "\n\n".join(b.text for b in content if isinstance(b, TextBlock))


def to_messages(system: str | list[TextBlock] | None, messages: list[InputMessage]) -> list[ChatMessage]:
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    out = _system_message(system)
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool messages answering them
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role == "system":  # the normalizer merges it into the system prompt
            out.append(ChatMessage(role="system", content=_system_text(message.content)))
        elif isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            out.append(_assistant_message(message.content, names, where))
        else:
            out.extend(_user_messages(message.content, names, where))
    return out


def _tool_defs(tools: list[Tool] | None) -> list[ToolDef] | None:
    """Client tools only: server tools (a versioned `type`, no `input_schema`) run on Anthropic's
    side, and this server has none, so they are left out."""
    if not tools:
        return None
    defs = [
        ToolDef(FunctionDef(t.name, t.description, t.input_schema))
        for t in tools
        if t.input_schema is not None or t.type in (None, "custom")
    ]
    return defs or None


def _tool_choice(body: CountTokensRequest, tools: list[ToolDef] | None) -> dict[str, object]:
    choice = body.tool_choice
    if choice is None:
        return {}
    if isinstance(choice, ToolChoiceNone):
        return {"tool_choice": "none"}
    names = {t.function.name for t in tools or []}
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise InvalidRequest(f"tool_choice {choice.__struct_config__.tag!r} needs tools", param="tool_choice")
    mapped: object = "auto"
    if isinstance(choice, ToolChoiceAny):
        mapped = "required"
    elif isinstance(choice, ToolChoiceTool):
        if choice.name not in names:
            raise InvalidRequest(f"tool_choice names an undeclared tool: {choice.name!r}", param="tool_choice.name")
        mapped = NamedToolChoice(choice.name)
    return {"tool_choice": mapped, "parallel_tool_calls": not choice.disable_parallel_tool_use}


def _thinking(body: CountTokensRequest) -> dict[str, object]:
    thinking = body.thinking
    if isinstance(thinking, ThinkingDisabled):
        return {"enable_thinking": False}
    if isinstance(thinking, ThinkingAdaptive):
        return {"enable_thinking": True}
    if isinstance(thinking, ThinkingEnabled):
        if thinking.budget_tokens is not None and thinking.budget_tokens < 1:
            raise InvalidRequest("thinking.budget_tokens must be at least 1", param="thinking.budget_tokens")
        return {"enable_thinking": True, "thinking_budget": thinking.budget_tokens}
    return {}  # not given: the chat template's default


def to_chat_request(body: CountTokensRequest) -> ChatRequest:
    """The prompt side of a request (all that `count_tokens` needs); `MessagesRequest` adds sampling.
    Anthropic's rule: a tool_choice that forces tool use (`any`, `tool`) excludes extended
    thinking (asking for both is a 400; forcing alone turns the template's thinking off)."""
    tools = _tool_defs(body.tools)
    fields: dict[str, object] = {**_tool_choice(body, tools), **_thinking(body)}
    if isinstance(body.tool_choice, ToolChoiceAny | ToolChoiceTool):
        if fields.get("enable_thinking"):
            raise InvalidRequest("thinking may not be enabled when tool_choice forces tool use", param="thinking")
        fields["enable_thinking"] = False
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            stop=tuple(body.stop_sequences or ()),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            specprefill=body.specprefill,
            specprefill_keep=body.specprefill_keep,
            specprefill_anchor_ngram=body.specprefill_anchor_ngram,
        )
    return ChatRequest(messages=to_messages(body.system, body.messages), tools=tools, **fields)  # type: ignore[arg-type]


# -- reply: events -> Anthropic ---------------------------------------------------------------------


def _signature(thinking: str) -> str:
    """An opaque signature for a thinking block; clients send it back and it is not checked."""
    return hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _stop(done: ReplyDone) -> StopInfo:
    reason: StopReason = "end_turn"
    if done.finish_reason == "length":
        reason = "max_tokens"
    elif done.finish_reason == "tool_calls":
        reason = "tool_use"
    elif done.stop_sequence is not None:
        reason = "stop_sequence"
    return StopInfo(reason, done.stop_sequence if reason == "stop_sequence" else None)


def _usage(done: ReplyDone) -> Usage:
    return Usage(
        input_tokens=done.prompt_tokens - done.cached_tokens,
        output_tokens=done.completion_tokens,
        cache_read_input_tokens=done.cached_tokens,
        specprefill=done.specprefill if done.specprefill is not None else msgspec.UNSET,
    )


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
            last.thinking, last.signature = text, _signature(text)
        elif isinstance(last, TextOut):
            last.text = text


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
                usage = _usage(ev) if isinstance(ev, ReplyDone) else Usage(0, 0)
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
            yield MessageDelta(_stop(ev), _usage(ev))
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
            yield ContentBlockDelta(self.index, SignatureDelta(_signature("".join(self._thinking))))
        yield ContentBlockStop(self.index)
        self.open = None


def sse_frame(event: StreamEvent | ErrorBody) -> bytes:
    name: str = type(event).__struct_config__.tag  # type: ignore[assignment]
    return b"event: " + name.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


def _error_frame(exc: BaseException) -> bytes:
    return b"event: error\ndata: " + error_body(_as_error(exc)) + b"\n\n"


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
        return [_error_frame(exc)]

    def end(self) -> list[bytes]:
        return []


class AnthropicRoutes:
    def __init__(self, config: ServerConfig, service: Callable[[], ChatService],
                 check_model: Callable[[str | None], str]) -> None:
        self.config = config
        self._service = service
        self._check_model = check_model

    async def messages(self, request: Request) -> Response:
        body = _decode(await request.body(), MessagesRequest, self.config.limits.max_json_depth)
        model = self._check_model(body.model)
        req = to_chat_request(body)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"

        async def collect(items: ObjectReceiveStream[Item]) -> Message:
            builder = MessageBuilder()
            async for ev in events_of(items):
                builder.feed(ev)
                if builder.done is not None:
                    break
            if builder.done is None:
                raise RelayError("the reply ended without finishing")
            stop = _stop(builder.done)
            return Message(message_id, model, builder.blocks, stop.stop_reason, stop.stop_sequence,
                           _usage(builder.done))

        return await respond(request, self._service(), [req], message_id, model=model, stream=body.stream,
                             encoder=AnthropicStream(message_id, model), collect=collect,
                             keepalive_s=self.config.sse_keepalive_s)

    async def count_tokens(self, request: Request) -> Response:
        body = _decode(await request.body(), CountTokensRequest, self.config.limits.max_json_depth)
        self._check_model(body.model)
        req = to_chat_request(body)
        count = await self._service().count_tokens(req)
        return Response(msgspec.json.encode(TokenCount(count)), media_type=JSON)


def anthropic_routes(config: ServerConfig, service: Callable[[], ChatService],
                     check_model: Callable[[str | None], str]) -> list[Route]:
    routes = AnthropicRoutes(config, service, check_model)
    return [
        Route("/v1/messages", _anthropic_errors(routes.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", _anthropic_errors(routes.count_tokens), methods=["POST"]),
    ]

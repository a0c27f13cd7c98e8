"""OpenAI Responses API (`POST /v1/responses`, as Codex uses it) over `ChatService.reply`.

    POST   /v1/responses        input items -> ChatRequest -> reply events -> response / SSE events
    GET    /v1/responses/{id}   a stored response
    DELETE /v1/responses/{id}

Input items become chat messages (`items_to_messages`): `instructions` a leading system message,
`function_call` items assistant `tool_calls` (merged into the assistant turn before them),
`function_call_output` items `tool` messages, reasoning items the next assistant turn's
`reasoning_content`. A namespace's tools (Codex's MCP tools) are offered to the model under
qualified names and their calls answered with `namespace` and the inner name
(`responses_names.ToolNames`). `previous_response_id` prepends a stored conversation (that request's input
without its instructions, as OpenAI does, then that response's output) from a bounded in-memory
`ResponseStore` owned by the routes.

`ResponseAssembler` turns reply events into output items and stream events; the same assembly
serves streamed and non-streamed responses. Items never interleave: an item is closed
(`*.done`, `output_item.done`) before the next one is added. As in `app.py`, everything that can
refuse a request happens before the response starts; a streamed response owns its generation
and a client disconnect cancels it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

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
    ResponseFormat,
    TextPart,
    ToolCall,
    ToolChoice,
    ToolDef,
)
from mlx_relay.config import ServerConfig
from mlx_relay.errors import InvalidRequest, NotFound, RelayError
from mlx_relay.http.body import decode_body
from mlx_relay.http.errors import as_relay_error
from mlx_relay.http.replies import Item
from mlx_relay.http.response_store import ResponseStore
from mlx_relay.http.responses_names import ToolNames
from mlx_relay.http.responses_types import (
    ContentPartAdded,
    ContentPartDone,
    DeletedResponse,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    FunctionToolChoice,
    IncompleteDetails,
    InputImagePart,
    InputItem,
    InputTextPart,
    InputTokensDetails,
    ItemStatus,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningConfig,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    RefusalPart,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextConfig,
    TextFormat,
    event_name,
)
from mlx_relay.http.streaming import events_of, respond
from mlx_relay.service import ChatRequest, ChatService

JSON = "application/json"


class PreviousResponseNotFound(RelayError):
    """`previous_response_id` names a response that was never stored, was evicted or deleted."""

    status = 404
    type = "invalid_request_error"
    code = "previous_response_not_found"


class ResponseNotFound(NotFound):
    """`GET`/`DELETE /v1/responses/{id}` for an id the store does not hold."""


class StoredResponse(msgspec.Struct):
    """What the store keeps per response: the response object and the whole conversation up to and
    including its output (without instructions), ready to prepend to a continuation."""

    response: ResponseObject
    messages: list[ChatMessage]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------------------------
# Request -> ChatRequest
# --------------------------------------------------------------------------------------------

_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}

_PART_TYPES: dict[str, type[InputTextPart | RefusalPart | InputImagePart]] = {
    "input_text": InputTextPart,
    "output_text": InputTextPart,
    "text": InputTextPart,
    "refusal": RefusalPart,
    "input_image": InputImagePart,
}


def _convert(raw: object, cls: type[Any], where: str) -> Any:
    """`raw` (a decoded JSON value) as `cls`; a mismatch is a 400 naming where it is."""
    try:
        return msgspec.convert(raw, type=cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{where}: {exc}", param=where) from None


def _type_of(raw: dict[str, Any], where: str, default: str | None = None) -> str:
    kind = raw.get("type", default)
    if not isinstance(kind, str):
        raise InvalidRequest(f"{where}.type is missing or not a string", param=f"{where}.type")
    return kind


# history items of OpenAI's hosted tools: nothing a local model can continue from, so left out
_HOSTED_CALL_ITEMS = frozenset({
    "web_search_call", "file_search_call", "tool_search_call", "image_generation_call", "code_interpreter_call",
    "computer_call", "computer_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "local_shell_call", "local_shell_call_output",
})


def _custom_as_function(raw: dict[str, Any], where: str) -> InputItem:
    """Codex's freeform tools (e.g. apply_patch) travel as function calls with one `input`."""
    if raw.get("type") == "custom_tool_call":
        args = json.dumps({"input": raw.get("input", "")}, ensure_ascii=False)
        return _convert({"call_id": raw.get("call_id"), "name": raw.get("name"), "arguments": args},
                        FunctionCallItem, where)
    return _convert({"call_id": raw.get("call_id"), "output": raw.get("output", "")}, FunctionCallOutputItem, where)


def parse_items(input: str | list[dict[str, Any]]) -> list[InputItem]:
    """The request's `input` as typed items; a string is one user message."""
    if isinstance(input, str):
        return [MessageItem(role="user", content=input)]
    items: list[InputItem] = []
    for i, raw in enumerate(input):
        where = f"input[{i}]"
        kind = _type_of(raw, where, default="message")
        if kind in _HOSTED_CALL_ITEMS:
            continue
        if kind in ("custom_tool_call", "custom_tool_call_output"):
            items.append(_custom_as_function(raw, where))
            continue
        cls = _ITEM_TYPES.get(kind)
        if cls is None:
            supported = ", ".join(_ITEM_TYPES)
            raise InvalidRequest(f"{where}: input item type '{kind}' is not supported (supported: {supported})",
                                 param=f"{where}.type")
        items.append(_convert(raw, cls, where))
    return items


def _parts(raw: str | list[dict[str, Any]], where: str) -> str | list[ContentPart]:
    """Message or tool-output content as chat content parts."""
    if isinstance(raw, str):
        return raw
    parts: list[ContentPart] = []
    for j, part in enumerate(raw):
        at = f"{where}[{j}]"
        kind = _type_of(part, at)
        cls = _PART_TYPES.get(kind)
        if cls is None:
            supported = ", ".join(_PART_TYPES)
            raise InvalidRequest(f"{at}: content part type '{kind}' is not supported (supported: {supported})",
                                 param=f"{at}.type")
        value = _convert(part, cls, at)
        if isinstance(value, InputTextPart):
            parts.append(TextPart(value.text))
        elif isinstance(value, RefusalPart):
            parts.append(TextPart(value.refusal))
        elif value.image_url:
            parts.append(ImageUrlPart(ImageUrl(value.image_url, value.detail)))
        else:
            raise InvalidRequest(f"{at}: input_image needs an image_url (a URL or a data URL); file_id is not "
                                 "supported", param=f"{at}.image_url")
    return parts


def _reasoning_text(item: ReasoningItem) -> str:
    texts = [p.text for p in item.content] if item.content else [p.text for p in item.summary]
    return "\n\n".join(t for t in texts if t)


def _join(left: str | None, right: str | None) -> str | None:
    if not left or not right:
        return left or right
    return left + "\n\n" + right


def items_to_messages(items: list[InputItem], names: ToolNames | None = None) -> list[ChatMessage]:
    """Chat messages for the items, in order. Function calls join the assistant turn right before
    them (its text and earlier calls), a namespaced one under the name the model knows it by
    (`names`); reasoning text goes to the next assistant turn (dropped if none follows)."""
    names = names or ToolNames()
    messages: list[ChatMessage] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning = _join(reasoning, _reasoning_text(item))
        elif isinstance(item, MessageItem):
            content = _parts(item.content, f"input[{i}].content")
            if item.role == "assistant":
                messages.append(ChatMessage("assistant", content, reasoning_content=reasoning))
                reasoning = None
            else:
                messages.append(ChatMessage(item.role, content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, FunctionCall(names.qualified(item.namespace, item.name), item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
                last.reasoning_content = _join(last.reasoning_content, reasoning)
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=[call], reasoning_content=reasoning))
            reasoning = None
        else:
            output = _parts(item.output, f"input[{i}].output")
            messages.append(ChatMessage("tool", output, tool_call_id=item.call_id))
    return messages


def output_messages(output: list[OutputItem], names: ToolNames | None = None) -> list[ChatMessage]:
    """A response's output as the assistant turn a continuation sees (namespaced calls under the
    names the model knows them by)."""
    names = names or ToolNames()
    turn = ChatMessage("assistant", "")
    for item in output:
        if isinstance(item, OutputReasoning):
            turn.reasoning_content = _join(turn.reasoning_content, "".join(p.text for p in item.content))
        elif isinstance(item, OutputMessage):
            text = "".join(p.text for p in item.content)
            turn.content = _join(turn.content if isinstance(turn.content, str) else None, text) or ""
        else:
            namespace = item.namespace if isinstance(item.namespace, str) else None
            call = ToolCall(item.call_id, FunctionCall(names.qualified(namespace, item.name), item.arguments))
            turn.tool_calls = [*(turn.tool_calls or []), call]
    return [turn]


_HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "image_generation", "code_interpreter",
                           "computer_use_preview", "local_shell", "mcp", "tool_search"})


def parse_tools(raw: list[dict[str, Any]] | None) -> tuple[list[FunctionTool], ToolNames]:
    """Function tools only; the flat Responses shape, or the nested Chat Completions one. A
    namespace's tools (Codex's MCP tools) are offered under qualified names (`responses_names`);
    the table maps the model's calls back."""
    found: list[tuple[str | None, FunctionTool]] = []
    for i, tool in enumerate(raw or []):
        where = f"tools[{i}]"
        if _type_of(tool, where) != "namespace":
            found.extend((None, t) for t in _function_tool(tool, where))
            continue
        namespace = tool.get("name")
        if not isinstance(namespace, str) or not namespace:
            raise InvalidRequest(f"{where}.name: a namespace needs a name", param=f"{where}.name")
        for j, inner in enumerate(tool.get("tools") or []):
            if isinstance(inner, dict):
                found.extend((namespace, t) for t in _function_tool(inner, f"{where}.tools[{j}]", nested=True))
    names = ToolNames()
    for namespace, t in found:  # flat names first: a qualified name never takes one
        if namespace is None:
            names.plain(t.name)
    tools = [t if ns is None else msgspec.structs.replace(t, name=names.add(ns, t.name)) for ns, t in found]
    return tools, names


def _function_tool(tool: dict[str, Any], where: str, nested: bool = False) -> list[FunctionTool]:
    """The tool as a function tool (none for OpenAI's hosted tools)."""
    kind = _type_of(tool, where)
    if kind == "custom":  # a freeform tool: offered as a function with one string `input`
        tool = {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}
        kind = "function"
    if kind in _HOSTED_TOOLS:  # OpenAI-hosted (web search, image generation, ...): not ours to run
        return []
    if kind != "function":
        what = "namespaces do not nest" if nested and kind == "namespace" else "only function tools are"
        raise InvalidRequest(f"{where}: tool type '{kind}' is not supported; {what}", param=f"{where}.type")
    if "name" not in tool and isinstance(tool.get("function"), dict):
        tool = {**tool["function"], "type": "function"}
    return [_convert(tool, FunctionTool, where)]


def parse_tool_choice(raw: str | dict[str, Any] | None, tools: list[FunctionTool], names: ToolNames | None = None
                      ) -> tuple[ToolChoice, str | FunctionToolChoice]:
    """`tool_choice` for the ChatRequest, and as the response echoes it (a namespaced function by
    its namespace and inner name)."""
    if raw is None:
        return "auto", "auto"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise InvalidRequest(f"tool_choice '{raw}' is not supported (auto, none, required or a function)",
                                 param="tool_choice")
        if raw == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool", param="tool_choice")
        return raw, raw  # type: ignore[return-value]
    kind = _type_of(raw, "tool_choice")
    if kind != "function":
        raise InvalidRequest(f"tool_choice type '{kind}' is not supported; only function", param="tool_choice")
    choice = _convert(raw, FunctionToolChoice, "tool_choice")
    namespace = choice.namespace if isinstance(choice.namespace, str) else None
    name = (names or ToolNames()).qualified(namespace, choice.name)
    if name not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names the function '{choice.name}', which is not among the tools",
                             param="tool_choice")
    return NamedToolChoice(name), choice


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema" and fmt.schema is None:
        raise InvalidRequest("text.format of type json_schema needs a schema", param="text.format.schema")
    return ResponseFormat(fmt.type, fmt.schema, fmt.name, fmt.strict)


def _text_echo(text: TextConfig | None) -> TextConfig:
    if text is None:
        return TextConfig(TextFormat("text"))
    return text if text.format is not None else msgspec.structs.replace(text, format=TextFormat("text"))


def thinking(reasoning: ReasoningConfig | None) -> bool | None:
    """`reasoning.effort` as the chat template's `enable_thinking`; no effort leaves its default."""
    if reasoning is None or reasoning.effort is None:
        return None
    return reasoning.effort.lower() not in ("none", "minimal")


def to_tool_defs(tools: list[FunctionTool]) -> list[ToolDef] | None:
    if not tools:
        return None
    return [ToolDef(FunctionDef(t.name, t.description, t.parameters, t.strict)) for t in tools]


def translate(body: ResponsesRequest, model: str, conversation: list[ChatMessage], tools: list[FunctionTool],
              names: ToolNames) -> tuple[ChatRequest, ResponseObject]:
    """The chat request for `conversation` (earlier turns and this input, as messages) under the
    body's settings with `tools` (`parse_tools`), and the response object that echoes them
    (`in_progress`, no output yet)."""
    if not conversation:
        raise InvalidRequest("input must not be empty", param="input")
    choice, choice_echo = parse_tool_choice(body.tool_choice, tools, names)
    system = [ChatMessage("system", body.instructions)] if body.instructions else []
    req = ChatRequest(
        messages=system + conversation,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=to_tool_defs(tools),
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        response_format=response_format(body.text),
        enable_thinking=thinking(body.reasoning),
        specprefill=body.specprefill,
        specprefill_keep=body.specprefill_keep,
        specprefill_anchor_ngram=body.specprefill_anchor_ngram,
    )
    response = ResponseObject(
        id=_new_id("resp"), created_at=int(time.time()), status="in_progress", model=model, output=[],
        parallel_tool_calls=req.parallel_tool_calls, tool_choice=choice_echo, tools=tools,
        text=_text_echo(body.text), store=body.store is not False, instructions=body.instructions,
        previous_response_id=body.previous_response_id, max_output_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, reasoning=body.reasoning,
        metadata=body.metadata or {}, user=body.user, prompt_cache_key=body.prompt_cache_key,
    )
    return req, response


# --------------------------------------------------------------------------------------------
# Reply events -> output items and stream events
# --------------------------------------------------------------------------------------------


class _OpenItem:
    """The output item being written: its kind, position, id and text so far."""

    def __init__(self, kind: Literal["reasoning", "message", "function_call"], index: int, item_id: str,
                 call_id: str = "", name: str = "", namespace: str | None = None) -> None:
        self.kind = kind
        self.index = index
        self.id = item_id
        self.call_id = call_id
        self.name = name
        self.namespace = namespace
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ResponseAssembler:
    """Builds `response.output` from reply events and yields the stream events that go with it,
    numbered in order. `response` starts `in_progress` with no output and is finished in place.
    A call to a namespaced tool (`names`) names its namespace and inner name."""

    def __init__(self, response: ResponseObject, names: ToolNames | None = None) -> None:
        self.response = response
        self.names = names or ToolNames()
        self.finished = False
        self._seq = 0
        self._open: _OpenItem | None = None

    def start(self) -> list[StreamEvent]:
        return self._numbered([ResponseCreated(response=self._snapshot()),
                               ResponseInProgress(response=self._snapshot())])

    def feed(self, ev: ReplyEvent) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if isinstance(ev, ReasoningDelta):
            if ev.text:
                item = self._ensure(out, "reasoning")
                item.parts.append(ev.text)
                out.append(ReasoningTextDelta(item_id=item.id, output_index=item.index, content_index=0,
                                              delta=ev.text))
        elif isinstance(ev, ContentDelta):
            if ev.text:
                item = self._ensure(out, "message")
                item.parts.append(ev.text)
                out.append(OutputTextDelta(item_id=item.id, output_index=item.index, content_index=0,
                                           delta=ev.text))
        elif isinstance(ev, ToolCallStart):
            self._open_call(out, ev.id, ev.name)
        elif isinstance(ev, ToolCallArguments):
            item = self._open if self._open is not None and self._open.kind == "function_call" else None
            if item is not None and ev.fragment:
                item.parts.append(ev.fragment)
                out.append(FunctionCallArgumentsDelta(item_id=item.id, output_index=item.index, delta=ev.fragment))
        elif isinstance(ev, ToolCallEnd):
            item = self._open
            if item is None or item.kind != "function_call" or item.call_id != ev.id:
                item = self._open_call(out, ev.id, ev.name)
            item.parts = [ev.arguments]
            self._close(out)
        elif isinstance(ev, ReplyDone):
            out.extend(self._finish(ev))
        return self._numbered(out)

    def fail(self, err: RelayError) -> list[StreamEvent]:
        """The reply broke off: the response fails with the items finished so far."""
        self._open = None
        self.response.status = "failed"
        self.response.error = ResponseError(code=err.code or "server_error", message=err.message)
        return self._numbered([ResponseFailed(response=self._snapshot())])

    def _finish(self, done: ReplyDone) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        cut = done.finish_reason == "length"
        self._close(out, "incomplete" if cut else "completed")
        r = self.response
        r.usage = ResponseUsage(
            input_tokens=done.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=done.cached_tokens),
            output_tokens=done.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=done.reasoning_tokens),
            total_tokens=done.prompt_tokens + done.completion_tokens,
            specprefill=done.specprefill if done.specprefill is not None else msgspec.UNSET,
        )
        if cut:
            r.status = "incomplete"
            r.incomplete_details = IncompleteDetails("max_output_tokens")
            out.append(ResponseIncomplete(response=self._snapshot()))
        else:
            r.status = "completed"
            out.append(ResponseCompleted(response=self._snapshot()))
        self.finished = True
        return out

    def _numbered(self, events: list[StreamEvent]) -> list[StreamEvent]:
        for ev in events:
            ev.sequence_number = self._seq
            self._seq += 1
        return events

    def _snapshot(self) -> ResponseObject:
        return msgspec.structs.replace(self.response, output=list(self.response.output))

    def _ensure(self, out: list[StreamEvent], kind: Literal["reasoning", "message"]) -> _OpenItem:
        """The open item if it is of `kind`; otherwise close it and open one."""
        if self._open is not None and self._open.kind == kind:
            return self._open
        self._close(out)
        index = len(self.response.output)
        if kind == "reasoning":
            item = _OpenItem(kind, index, _new_id("rs"))
            added: OutputItem = OutputReasoning(id=item.id, summary=[], content=[])
            part: OutputText | ReasoningText = ReasoningText("")
        else:
            item = _OpenItem(kind, index, _new_id("msg"))
            added = OutputMessage(id=item.id, status="in_progress", content=[])
            part = OutputText("")
        out.append(OutputItemAdded(output_index=index, item=added))
        out.append(ContentPartAdded(item_id=item.id, output_index=index, content_index=0, part=part))
        self._open = item
        return item

    def _open_call(self, out: list[StreamEvent], call_id: str, qualified: str) -> _OpenItem:
        self._close(out)
        index = len(self.response.output)
        namespace, name = self.names.split(qualified)
        item = _OpenItem("function_call", index, _new_id("fc"), call_id, name, namespace)
        added = OutputFunctionCall(id=item.id, call_id=call_id, name=name, arguments="", status="in_progress",
                                   namespace=_or_unset(namespace))
        out.append(OutputItemAdded(output_index=index, item=added))
        self._open = item
        return item

    def _close(self, out: list[StreamEvent], status: ItemStatus = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        text, at = item.text, {"item_id": item.id, "output_index": item.index}
        done: OutputItem
        if item.kind == "reasoning":
            out.append(ReasoningTextDone(**at, content_index=0, text=text))
            out.append(ContentPartDone(**at, content_index=0, part=ReasoningText(text)))
            done = OutputReasoning(id=item.id, summary=[], content=[ReasoningText(text)])
        elif item.kind == "message":
            out.append(OutputTextDone(**at, content_index=0, text=text))
            out.append(ContentPartDone(**at, content_index=0, part=OutputText(text)))
            done = OutputMessage(id=item.id, status=status, content=[OutputText(text)])
        else:
            text = text or "{}"  # a call's arguments are always a JSON object
            out.append(FunctionCallArgumentsDone(**at, arguments=text, name=item.name))
            done = OutputFunctionCall(id=item.id, call_id=item.call_id, name=item.name, arguments=text,
                                      status=status, namespace=_or_unset(item.namespace))
        self.response.output.append(done)
        out.append(OutputItemDone(output_index=item.index, item=done))


def _or_unset(namespace: str | None) -> str | msgspec.UnsetType:
    return msgspec.UNSET if namespace is None else namespace


def sse_frame(ev: StreamEvent) -> bytes:
    return b"event: " + event_name(ev).encode() + b"\ndata: " + msgspec.json.encode(ev) + b"\n\n"


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


class ResponsesStream:
    """The Responses API's numbered stream events as SSE frames (`streaming.SSEEncoder`):
    `response.created` and `response.in_progress` first, `response.completed` / `.incomplete`
    last (the response is stored before the client hears of it), `response.failed` when the
    generation fails after the response started."""

    def __init__(self, assembler: ResponseAssembler, finished: Callable[[], None]) -> None:
        self.assembler = assembler
        self._finished = finished

    @property
    def done(self) -> bool:
        return self.assembler.finished

    def start(self) -> list[bytes]:
        return [sse_frame(ev) for ev in self.assembler.start()]

    def event(self, index: int, ev: ReplyEvent) -> list[bytes]:
        frames = self.assembler.feed(ev)
        if self.assembler.finished:
            self._finished()
        return [sse_frame(e) for e in frames]

    def failed(self, exc: Exception) -> list[bytes]:
        return [sse_frame(ev) for ev in self.assembler.fail(as_relay_error(exc))]

    def end(self) -> list[bytes]:
        return []


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type=JSON)


class ResponsesRoutes:
    def __init__(self, config: ServerConfig, service: Callable[[], ChatService],
                 check_model: Callable[[str | None], str], store: ResponseStore[StoredResponse] | None = None) -> None:
        self.config = config
        self._service = service
        self._check_model = check_model
        self.store: ResponseStore[StoredResponse] = store if store is not None else ResponseStore()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/responses/{response_id}", self.delete, methods=["DELETE"]),
        ]

    async def retrieve(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            raise ResponseNotFound(f"no stored response with id '{rid}'", param="response_id")
        return _json(stored.response)

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if not self.store.delete(rid):
            raise ResponseNotFound(f"no stored response with id '{rid}'", param="response_id")
        return _json(DeletedResponse(rid))

    async def create(self, request: Request) -> Response:
        body = decode_body(await request.body(), ResponsesRequest, self.config.limits.max_json_depth)
        model = self._check_model(body.model)
        tools, names = parse_tools(body.tools)
        conversation = self._prior(body.previous_response_id) + items_to_messages(parse_items(body.input), names)
        req, response = translate(body, model, conversation, tools, names)
        assembler = ResponseAssembler(response, names)

        def finished() -> None:
            if response.store:
                self._remember(response, conversation, names)

        async def collect(items: ObjectReceiveStream[Item]) -> ResponseObject:
            async for ev in events_of(items):
                assembler.feed(ev)
                if assembler.finished:
                    break
            if not assembler.finished:
                raise RelayError("the reply ended without finishing")
            finished()
            return response

        return await respond(request, self._service(), [req], response.id, model=model, stream=body.stream,
                             encoder=ResponsesStream(assembler, finished), collect=collect,
                             keepalive_s=self.config.sse_keepalive_s)

    def _prior(self, previous_id: str | None) -> list[ChatMessage]:
        if previous_id is None:
            return []
        stored = self.store.get(previous_id)
        if stored is None:
            raise PreviousResponseNotFound(
                f"previous response with id '{previous_id}' not found (never stored, store=false, evicted or "
                "deleted); send the whole conversation as input instead", param="previous_response_id")
        return list(stored.messages)

    def _remember(self, response: ResponseObject, conversation: list[ChatMessage], names: ToolNames) -> None:
        entry = StoredResponse(response, conversation + output_messages(response.output, names))
        self.store.put(response.id, entry, len(msgspec.json.encode(entry)))


def responses_routes(config: ServerConfig, service: Callable[[], ChatService],
                     check_model: Callable[[str | None], str]) -> list[Route]:
    return ResponsesRoutes(config, service, check_model).routes()

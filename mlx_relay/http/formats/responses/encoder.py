"""OpenAI Responses API: reply events as output items and numbered stream events
(`ResponseAssembler`), and those as SSE frames (`ResponsesStream`, a `streaming.SSEEncoder`).

The same assembly serves the non-streamed body (`collector.py`): the response it finishes in
place is the body. Items never interleave: an item is closed (`*.done`, `output_item.done`)
before the next one is added. A call to a namespaced tool names its namespace and inner name
(`tools.ToolNames`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyDone,
    ReplyEvent,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.errors import RelayError
from mlx_relay.http.errors import as_relay_error
from mlx_relay.http.formats.responses.events import (
    ContentPartAdded,
    ContentPartDone,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    OutputTextDone,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    StreamEvent,
    event_name,
)
from mlx_relay.http.formats.responses.tools import ToolNames
from mlx_relay.http.formats.responses.types import (
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    new_id,
)
from mlx_relay.http.formats.speculation import speculation_usage


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
        if not self._answered():  # a reply of reasoning alone (or nothing) still has its message, empty
            self._ensure(out, "message")
        self._close(out, "incomplete" if cut else "completed")
        r = self.response
        speculation = speculation_usage([done])
        r.usage = ResponseUsage(
            input_tokens=done.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=done.cached_tokens),
            output_tokens=done.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=done.reasoning_tokens),
            total_tokens=done.prompt_tokens + done.completion_tokens,
            speculation=speculation if speculation is not None else msgspec.UNSET,
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

    def _answered(self) -> bool:
        """Whether the reply has a message or a call so far (open or done): every response that
        ends has one, its text events closed, as a client that reads `output_text.done` expects."""
        if self._open is not None and self._open.kind != "reasoning":
            return True
        return any(isinstance(item, (OutputMessage, OutputFunctionCall)) for item in self.response.output)

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
            item = _OpenItem(kind, index, new_id("rs"))
            added: OutputItem = OutputReasoning(id=item.id, summary=[], content=[])
            part: OutputText | ReasoningText = ReasoningText("")
        else:
            item = _OpenItem(kind, index, new_id("msg"))
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
        item = _OpenItem("function_call", index, new_id("fc"), call_id, name, namespace)
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

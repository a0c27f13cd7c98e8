"""ReplyParser: splits a reply's streamed text into reasoning, content and tool calls.

Runs on the event loop side of `ChatService.reply` (pure Python, no MLX), one parser per reply.
Text arrives in arbitrary pieces (an engine delta may end in the middle of a tag); the parser
holds back any tail that could still become a tag, so neither the tags of the thinking block nor
anything of a `<tool_call>` block (`<function=`, `<parameter=`, JSON) ever reaches a `ContentDelta`.

A reply reads as: an optional thinking block (open from the prompt when `think_open`, or opened by
a leading `<think>`), then content with tool calls in it. A call is a `<tool_call>...</tool_call>`
block holding either Qwen3-Coder XML (`<function=NAME><parameter=P>value</parameter></function>`)
or a Hermes-style JSON object (`{"name": ..., "arguments": {...}}`); the block's shape decides
which, whatever `tool_format` names (models trained on one sometimes write the other), and
`tool_format=None` turns tool parsing off. A `<function=...>...</function>` the model wrote
without its `<tool_call>` is read as a call too, and closing tags with no opener (`</parameter>`,
`</function>`, `</tool_call>` in content) are dropped: with tools declared, no call markup reaches
the content.

What the model writes wrong is never an error of the reply (the client sees what the model did,
and an agent can reject a call and tell the model); each case is reported to `on_invalid` with
its reason (`chat.output.INVALID_REASONS`, counted in `/metrics`):

- `undeclared_tool`: a call to a function that is not among the tools is delivered as written
  (its name, its arguments as a JSON object string);
- `schema_mismatch`: arguments that do not fit the tool's parameter schema are delivered as written;
- `unreadable`: a block that cannot be read as a call (not JSON, no function, arguments that are not
  a JSON object) is delivered as plain content, the block's text as the model wrote it; but an XML
  block that names its function (`ToolCallStart` streams as soon as the name is read) is a call to
  it with arguments `{}` (the agent's schema check rejects it and tells the model);
- `unclosed`: a block still open when the reply ends ("stop") is read as if closed there (a call,
  or content as above);
- `stray_markup`: a closing tag with no opener, dropped.

A call cut by max_tokens ("length") is no error: it is dropped (a call starts, `ToolCallStart`, only
when its block is whole, so none is ever announced and then cut: the reply says "length" and has
no call with arguments its schema refuses). Arguments are always a JSON object string, never "".

Every feed looks only at the text held back so far plus the new piece (a call block keeps its
pieces in a list and only the last few characters are searched again), so feeding a long reply
character by character stays linear.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from mlx_relay.chat import tool_schema
from mlx_relay.chat.library_tool_parsers import json_tools, qwen3_coder
from mlx_relay.chat.output import (
    ContentDelta,
    InvalidReason,
    ReasoningDelta,
    ReplyEvent,
    TokenLogprob,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.chat.types import TOOL_FORMATS, ToolDef

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END, PARAMETER_END = "<function=", "</function>", "</parameter>"
_STRAY = (CALL_END, FUNCTION_END, PARAMETER_END)  # closing tags that mean nothing in content
_CONTENT_TAGS = (CALL_START, FUNCTION_START, *_STRAY)
_NAME = re.compile(r"\s*([^\s<>]+)(?=[\s<>])")  # mlx-lm's function-name rule, once the name has ended
_HEAD_LIMIT = 512  # a call block that names no function this early is left to the parse at its end
_WHITESPACE = " \t\r\n"

OnInvalid = Callable[[InvalidReason, str], None]  # (reason, what the model wrote wrong)


def tool_format_for_template(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches: "qwen3_coder" for `<function=` blocks,
    "json" for `<tool_call>` blocks holding a JSON object, None when it shows neither."""
    if not chat_template:
        return None
    if FUNCTION_START in chat_template:
        return "qwen3_coder"
    if CALL_START in chat_template and ('"name"' in chat_template or "tool_call.name" in chat_template):
        return "json"
    return None


def reasoning_in_template(chat_template: str | None) -> bool:
    """Whether a chat template writes thinking blocks (the model reasons before it answers)."""
    return chat_template is not None and THINK_START in chat_template


def _partial_tail(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of one of `tags`."""
    keep = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), keep, -1):
            if buf.endswith(tag[:k]):
                keep = k
                break
    return keep


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _Mode(enum.Enum):
    START = "start"  # nothing decided yet: the reply may still open with <think>
    THINK = "think"
    CONTENT = "content"
    CALL = "call"  # inside <tool_call> ... </tool_call>


class _Call:
    """The tool call being read: its block text so far (in pieces), and its name and id once known.
    `end`: the tag that closes it (`</tool_call>`, or `</function>` for a bare `<function=` block,
    whose text then starts with its opener)."""

    __slots__ = ("end", "head", "id", "index", "name", "parts", "size", "tail")

    def __init__(self, index: int, end: str = CALL_END) -> None:
        self.index = index
        self.end = end
        self.parts: list[str] = []
        self.size = 0
        self.tail = ""  # the block's last len(end) - 1 characters: where a split end tag may start
        self.head: str | None = ""  # the block's start while the function name is still unread
        self.name: str | None = None
        self.id: str | None = None

    def add(self, text: str) -> None:
        self.parts.append(text)
        self.size += len(text)
        self.tail = (self.tail + text)[-(len(self.end) - 1):]

    @property
    def written(self) -> str:
        """The block as the model wrote it, tags included."""
        body = "".join(self.parts)
        return body if self.end == FUNCTION_END else CALL_START + body


class _Unreadable(ValueError):
    """A block that cannot be read as a tool call (the message says why)."""


class ReplyParser:
    """One reply's text in, `ReplyEvent`s out (see `mlx_relay.chat.output` for their order).
    `on_invalid` hears of each thing the model wrote wrong (the module's docstring lists them)."""

    def __init__(self, *, tools: list[ToolDef] | None = None, tool_format: str | None = "qwen3_coder",
                 think_open: bool = False, on_invalid: OnInvalid | None = None) -> None:
        if tool_format is not None and tool_format not in TOOL_FORMATS:
            raise ValueError(f"unknown tool format {tool_format!r} (known: {', '.join(TOOL_FORMATS)})")
        self.tools = tools or []
        self.tool_format = tool_format if self.tools else None
        self._defs = {t.function.name: t for t in self.tools}
        self._keys = {t.function.name: tool_schema.schema_key(t.function.parameters) for t in self.tools}
        self._dicts = {t.function.name: msgspec.to_builtins(t) for t in self.tools}  # OpenAI-style, for mlx-lm
        self._on_invalid = on_invalid
        self._mode = _Mode.THINK if think_open else _Mode.START
        self._buf = ""  # text held back: it may still become a tag
        self._skip = ""  # characters to drop from the start of what comes next
        self._call: _Call | None = None
        self._logprobs: list[TokenLogprob] = []  # of tokens whose text is still held back
        self.calls = 0

    # -- the public side -------------------------------------------------------------------

    @property
    def held_back(self) -> int:
        """Characters every later feed searches again: the text held back (it may still become a
        tag) and, inside a call, its unread head and the tail where a split end tag may start.
        Bounded by the tags' lengths and the head limit, so a feed's work does not grow with the reply."""
        call = self._call
        return len(self._buf) + (len(call.head or "") + len(call.tail) if call is not None else 0)

    @property
    def thinking(self) -> bool:
        """Inside the thinking block (what comes next is reasoning, up to its `</think>`)."""
        return self._mode is _Mode.THINK

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> list[ReplyEvent]:
        """The events that `text` (the reply's next piece) completes. `logprobs` go on the first
        `ContentDelta` among them; while the text is held back (a possible tag) they wait for the
        content it becomes; tokens that became reasoning or tool calls lose theirs."""
        out: list[ReplyEvent] = []
        pending: str | None = text
        while pending is not None:
            if self._skip:
                pending = pending.lstrip(self._skip)
                if not pending:
                    break
                self._skip = ""
            pending = self._step(pending, out)
        if logprobs is not None:
            self._logprobs.extend(logprobs)
        return self._attach_logprobs(out)

    def finish(self, reason: str = "stop") -> list[ReplyEvent]:
        """The reply ended (`reason`: the engine's "stop" or "length"): held text that never became
        a tag is content (reasoning inside an unclosed thinking block). A tool call cut by
        max_tokens is dropped (it was never announced); one the model left unclosed otherwise is
        read as if closed here (`unclosed`)."""
        out: list[ReplyEvent] = []
        if self._mode is _Mode.CALL:
            call, self._call, self._mode = self._call, None, _Mode.CONTENT
            assert call is not None
            if reason != "length":  # cut by max_tokens: dropped (never announced)
                self._invalid("unclosed", f"the reply ended inside {_what(call)} (no {call.end})")
                self._close_call(call, "".join(call.parts), out, closed=False)
            return self._attach_logprobs(out)
        buf, self._buf = self._buf, ""
        if buf:
            out.append(ReasoningDelta(buf) if self._mode is _Mode.THINK else ContentDelta(buf))
        return self._attach_logprobs(out)

    def _attach_logprobs(self, out: list[ReplyEvent]) -> list[ReplyEvent]:
        if not self._logprobs:
            return out
        for i, ev in enumerate(out):
            if isinstance(ev, ContentDelta):
                out[i] = ContentDelta(ev.text, self._logprobs)
                self._logprobs = []
                return out
        if out and not self._buf:  # the tokens became reasoning or tool calls
            self._logprobs = []
        return out

    def _invalid(self, reason: InvalidReason, what: str) -> None:
        if self._on_invalid is not None:
            self._on_invalid(reason, what)

    # -- one step per mode: take text, return what is left for the next mode (None: wait) ------

    def _step(self, text: str, out: list[ReplyEvent]) -> str | None:
        if self._mode is _Mode.CALL:
            return self._in_call(text, out)
        if self._mode is _Mode.THINK:
            return self._in_think(text, out)
        if self._mode is _Mode.START:
            return self._at_start(text)
        return self._in_content(text, out)

    def _at_start(self, text: str) -> str | None:
        buf = self._buf + text
        head = buf.lstrip()
        if head.startswith(THINK_START):
            self._buf, self._mode, self._skip = "", _Mode.THINK, "\n"
            return head[len(THINK_START):]
        if THINK_START.startswith(head):  # only whitespace or a partial "<think>" so far
            self._buf = buf
            return None
        self._buf, self._mode = "", _Mode.CONTENT
        return buf

    def _in_think(self, text: str, out: list[ReplyEvent]) -> str | None:
        buf = self._buf + text
        i = buf.find(THINK_END)
        if i < 0:
            cut = len(buf) - _partial_tail(buf, (THINK_END,))
            self._buf = buf[cut:]
            _add(out, ReasoningDelta, buf[:cut])
            return None
        _add(out, ReasoningDelta, buf[:i])
        self._buf, self._mode, self._skip = "", _Mode.CONTENT, "\n"
        return buf[i + len(THINK_END):]

    def _in_content(self, text: str, out: list[ReplyEvent]) -> str | None:
        if self.tool_format is None:
            _add(out, ContentDelta, text)
            return None
        buf = self._buf + text
        found = [(i, tag) for tag in _CONTENT_TAGS if (i := buf.find(tag)) >= 0]
        if not found:
            cut = len(buf) - _partial_tail(buf, _CONTENT_TAGS)
            self._buf = buf[cut:]
            _add(out, ContentDelta, buf[:cut])
            return None
        i, tag = min(found)
        _add(out, ContentDelta, buf[:i])
        self._buf = ""
        if tag in _STRAY:  # a closing tag with no opener: dropped
            self._invalid("stray_markup", f"{tag} with no opener")
            self._skip = _WHITESPACE
            return buf[i + len(tag):]
        self._mode = _Mode.CALL
        if tag == CALL_START:
            self._call = _Call(self.calls)
            return buf[i + len(CALL_START):]
        self._call = _Call(self.calls, FUNCTION_END)  # a bare <function=...> block: its opener is its text
        return buf[i:]

    def _in_call(self, text: str, out: list[ReplyEvent]) -> str | None:
        call = self._call
        assert call is not None
        i = (call.tail + text).find(call.end)
        if i < 0:
            call.add(text)
            self._read_name(call, text, out)
            return None
        end = call.size - len(call.tail) + i  # where the end tag starts in the whole block
        whole = "".join(call.parts) + text
        block = whole[:end] + (call.end if call.end == FUNCTION_END else "")
        call.parts, call.size = [block], len(block)
        self._mode, self._call, self._skip = _Mode.CONTENT, None, _WHITESPACE
        self._close_call(call, block, out)
        return whole[end + len(call.end):]

    # -- tool calls ---------------------------------------------------------------------------

    def _read_name(self, call: _Call, text: str, out: list[ReplyEvent]) -> None:
        """Read an XML block's `<function=NAME>` as it streams (the call itself starts, `ToolCallStart`,
        only when its block is whole: a call cut by max_tokens is never announced, so it never
        reaches the client with arguments its schema refuses)."""
        if call.head is None or call.name is not None:
            return
        call.head += text
        if call.head.lstrip().startswith(("{", "[")) or len(call.head) > _HEAD_LIMIT:  # JSON, or no name early
            call.head = None
            return
        name = _function_name(call.head)
        if name is not None:
            call.head, call.name = None, name

    def _start_call(self, call: _Call, name: str, out: list[ReplyEvent]) -> None:
        if name not in self._defs:
            declared = ", ".join(self._defs)
            self._invalid("undeclared_tool", f"the model called {name!r}, which is not a declared tool "
                                             f"(declared: {declared})")
        call.name, call.id = name, _new_id()
        out.append(ToolCallStart(call.index, call.id, name))

    def _close_call(self, call: _Call, block: str, out: list[ReplyEvent], *, closed: bool = True) -> None:
        """The block is whole (`closed`: its end tag came): its calls, each checked against its
        schema; a block that cannot be read is content as written (or, announced already, a call
        with arguments `{}`)."""
        text = block.strip()
        try:
            parsed = self._parse_json(text) if text.startswith(("{", "[")) else [self._parse_xml(text)]
            if not parsed:
                raise _Unreadable("the tool call names no function")
        except _Unreadable as e:
            self._invalid("unreadable", f"{e}: {text[:200]!r}")
            name = call.name or _function_name(text)
            if name is not None:  # an XML block that names its function is a call, however it streamed
                self._start_call(call, name, out)
                self._end_call(call, {}, out)
            else:
                out.append(ContentDelta(call.written + (CALL_END if closed and call.end == CALL_END else "")))
            return
        for n, (name, arguments) in enumerate(parsed):
            this = call if n == 0 else _Call(self.calls)
            self._start_call(this, name, out)
            problem = tool_schema.argument_error(self._keys[name], arguments) if name in self._keys else None
            if problem is not None:
                self._invalid("schema_mismatch", f"invalid arguments in the tool call to {name}: {problem}")
            self._end_call(this, arguments, out)

    def _end_call(self, call: _Call, arguments: dict[str, Any], out: list[ReplyEvent]) -> None:
        assert call.name is not None and call.id is not None
        args = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        out.append(ToolCallArguments(call.index, args))
        out.append(ToolCallEnd(call.index, call.id, call.name, args))
        self.calls += 1

    def _parse_xml(self, text: str) -> tuple[str, dict[str, Any]]:
        """A Qwen3-Coder block through mlx-lm's parser (a block missing its `</function>` is read
        as if it had one). mlx-lm converts each value by its property's "type" alone (a "string"
        value stays text, "integer" goes through float(), no "type" keeps text unless it is a JSON
        object or array), which misreads nullable types, anyOf and $ref; so each value is also
        read as the raw text and as JSON, and the schema picks the reading. Undeclared functions
        keep mlx-lm's untyped reading."""
        parser = qwen3_coder()
        try:
            raw = parser.parse_tool_call(text)
        except ValueError as e:
            if FUNCTION_START not in text or text.endswith(FUNCTION_END):
                raise _Unreadable(f"the tool call could not be read ({e})") from e
            text += "\n" + FUNCTION_END
            try:
                raw = parser.parse_tool_call(text)
            except ValueError:
                raise _Unreadable(f"the tool call could not be read ({e})") from e
        name = raw["name"]
        if name not in self._defs:
            return name, _json_safe(raw["arguments"])
        try:
            typed = parser.parse_tool_call(text, [self._dicts[name]])["arguments"]
        except (ValueError, OverflowError):  # a value its "type" cannot hold ("abc", 1e400 for an integer)
            typed = {}
        candidates = {key: _readings(key, value, typed) for key, value in raw["arguments"].items()}
        return name, _json_safe(tool_schema.choose_values(self._keys[name], candidates))

    def _parse_json(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        """A Hermes-style block through mlx-lm's parser: an object (or a list of them) with a
        "name" and "arguments" (an object, or a string holding one)."""
        try:
            parsed = json_tools().parse_tool_call(text)
        except (ValueError, RecursionError) as e:
            raise _Unreadable(f"the tool call is not valid JSON ({e})") from e
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                raise _Unreadable("the tool call has no function name")
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except (ValueError, RecursionError) as e:
                    raise _Unreadable(f"the arguments of the tool call to {item['name']} are not JSON ({e})") from e
            if not isinstance(arguments, dict):
                raise _Unreadable(f"the arguments of the tool call to {item['name']} are not a JSON object")
            calls.append((item["name"], _json_safe(arguments)))
        return calls


def _function_name(text: str) -> str | None:
    """The function an XML block names (`<function=NAME>`), once its name has ended; a JSON block none."""
    head = text.lstrip()
    if head.startswith(("{", "[")):
        return None
    i = head.find(FUNCTION_START)
    match = _NAME.match(head, i + len(FUNCTION_START)) if i >= 0 else None
    return match.group(1) if match is not None else None


def _what(call: _Call) -> str:
    return f"a tool call to {call.name}" if call.name else "a tool call"


def _json_safe(arguments: dict[str, Any]) -> dict[str, Any]:
    """Arguments that JSON can carry: a value JSON has no form for (NaN, infinities, Python values
    mlx-lm's literal reading made) makes the block unreadable."""
    try:
        json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise _Unreadable(f"the arguments cannot be JSON ({e})") from e
    return arguments


def _readings(key: str, raw: Any, typed: dict[str, Any]) -> list[Any]:
    """An XML argument's candidate values: mlx-lm's typed value, the raw text, the text as JSON."""
    values = [typed[key]] if key in typed else []
    values.append(raw)
    if isinstance(raw, str):
        try:
            values.append(json.loads(raw))
        except ValueError:
            pass
    return values


def _add(out: list[ReplyEvent], kind: type[ReasoningDelta] | type[ContentDelta], text: str) -> None:
    if text:
        out.append(kind(text))

"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`): the official SDK and raw SSE
against a real server on the float32 tiny model, and the translation layer on its own (request
conversion, stream framing, tool calls, errors) against a scripted reply."""

from __future__ import annotations

import base64
import io
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anthropic
import anyio
import httpx
import httpx2
import numpy as np
import pytest
from PIL import Image
from starlette.applications import Starlette

from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyDone,
    ReplyEvent,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import FunctionDef, ImageUrlPart, NamedToolChoice, TextPart, ToolDef
from mlx_relay.errors import (
    GenerationFailed,
    InvalidRequest,
    MaxTokensExceedContext,
    ModelNotFound,
    NotReady,
    Overloaded,
    PromptTooLong,
)
from mlx_relay.http.formats.anthropic.request import to_chat_request
from mlx_relay.http.formats.anthropic.routes import anthropic_routes
from mlx_relay.http.formats.anthropic.types import CountTokensRequest, MessagesRequest, ThinkingEnabled
from mlx_relay.relay import default_config
from mlx_relay.service import ChatRequest, ReplyTally
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

MODEL = "tiny"
GREEDY = {"temperature": 0}  # this SDK version has no sampling parameters: they go as extra body fields
SYSTEM_BLOCKS = [
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Use the tools when they help.", "cache_control": {"type": "ephemeral"}},
]
TOOLS = [
    {"name": "read_file", "description": "Read a file from disk",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
     "cache_control": {"type": "ephemeral"}},
    {"name": "bash", "description": "Run a shell command",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
]
# a Claude Code-shaped turn: the assistant thought, called two tools, got the results (one failed)
CLAUDE_CODE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>cwd is /repo</system-reminder>"},
        {"type": "text", "text": "What does main.py do?", "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should read the file.", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_01", "name": "read_file", "input": {"path": "main.py"}},
        {"type": "tool_use", "id": "toolu_02", "name": "bash", "input": {"command": "ls"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01", "content": "print('hi')"},
        {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
         "content": [{"type": "text", "text": "ls: permission denied"}]},
        {"type": "text", "text": "Now explain it in one line."}]},
]


def png_base64(seed: int, size: tuple[int, int] = (64, 48)) -> str:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# -- a real server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(fp32_model: Path) -> Iterator[LiveServer]:
    config = default_config(fp32_model, served_model_name=MODEL, max_num_seqs=4, max_queue=16)
    with LiveServer(config) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0, timeout=120)


def post(url: str, body: dict[str, Any], path: str = "/v1/messages") -> httpx.Response:
    return local_http.post(url + path, json=body, timeout=120)


def message_body(content: Any = "Hello there", **extra: Any) -> dict[str, Any]:
    messages = user(content) if isinstance(content, str) else content
    return {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": messages, **extra}


def sse_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events, each frame checked: `event: NAME` then `data: JSON` of that type."""
    events: list[dict[str, Any]] = []
    name: str | None = None
    with local_http.stream("POST", url + "/v1/messages", json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            if line.startswith("event: "):
                assert name is None, "two event lines in one frame"
                name = line[len("event: "):]
                continue
            assert line.startswith("data: ") and name is not None, line
            data = json.loads(line[len("data: "):])
            assert data["type"] == name
            events.append(data)
            name = None
    return events


def assert_well_formed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checks Anthropic's exact event order and returns the content blocks the stream built:
    message_start, [ping], (content_block_start, content_block_delta*, content_block_stop)* with
    indices 0, 1, ... never interleaved, message_delta, message_stop."""
    types = [e["type"] for e in events]
    assert types[0] == "message_start"
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["content"] == []
    assert start["stop_reason"] is None and start["model"] == MODEL
    i = 2 if types[1] == "ping" else 1
    assert types[-2:] == ["message_delta", "message_stop"]
    blocks: list[dict[str, Any]] = []
    while i < len(events) - 2:
        ev = events[i]
        assert ev["type"] == "content_block_start" and ev["index"] == len(blocks), types
        block = dict(ev["content_block"])
        partial_json = ""
        i += 1
        deltas: list[str] = []
        while events[i]["type"] == "content_block_delta":
            assert events[i]["index"] == ev["index"]
            delta = events[i]["delta"]
            deltas.append(delta["type"])
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            else:
                partial_json += delta["partial_json"]
            i += 1
        assert events[i] == {"type": "content_block_stop", "index": ev["index"]}
        i += 1
        expected = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                    "tool_use": {"input_json_delta"}}[block["type"]]
        assert set(deltas) <= expected and deltas, (block["type"], deltas)
        if block["type"] == "thinking":
            assert deltas[-1] == "signature_delta" and deltas.count("signature_delta") == 1
            assert block["signature"]
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial_json)
        blocks.append(block)
    delta = events[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert delta["usage"]["output_tokens"] >= 0 and delta["usage"]["input_tokens"] >= 0
    return blocks


def test_non_stream_text_message(live: LiveServer, client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": "Hello there"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.id.startswith("msg_")
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type in ("text", "thinking") for b in msg.content)
    assert 0 < msg.usage.output_tokens <= 12
    assert msg.usage.input_tokens > 0 and msg.usage.cache_read_input_tokens is not None
    raw = post(live.url, message_body()).json()
    assert raw["type"] == "message" and raw["stop_sequence"] is None
    # Anthropic's four, and mlx-relay's drafts per source when a source drafted
    assert set(raw["usage"]) - {"speculation"} == {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                                                   "cache_read_input_tokens"}
    assert [b["type"] for b in raw["content"]] == [b.type for b in msg.content]


def test_stream_events_match_the_non_stream_message(live: LiveServer, client: anthropic.Anthropic) -> None:
    body = message_body("Write a function that adds two numbers", max_tokens=16)
    full = post(live.url, body).json()
    events = sse_events(live.url, body)
    blocks = assert_well_formed(events)
    assert blocks == full["content"]
    assert events[-2]["delta"]["stop_reason"] == full["stop_reason"]
    assert events[-2]["usage"]["output_tokens"] == full["usage"]["output_tokens"]
    usage = events[-2]["usage"]
    prompt = full["usage"]["input_tokens"] + full["usage"]["cache_read_input_tokens"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    # and through the SDK's stream helper, which accumulates the same message
    with client.messages.stream(model=MODEL, max_tokens=16, extra_body=GREEDY,
                                messages=body["messages"]) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.model_dump(exclude_none=True) for b in final.content] == full["content"]
    assert final.stop_reason == full["stop_reason"]
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == prompt


def test_system_blocks_and_unknown_fields_are_accepted(live: LiveServer) -> None:
    body = message_body(system=SYSTEM_BLOCKS, metadata={"user_id": "u1"}, service_tier="auto",
                        some_future_field={"x": 1}, top_p=0.9, top_k=20, stop_sequences=["\n\n\n"])
    r = post(live.url, body)
    assert r.status_code == 200, r.text
    as_string = post(live.url, message_body(system="You are a coding agent.\n\nUse the tools when they help."))
    # the blocks are joined into one system prompt: the same prompt as the string
    usage, usage_s = r.json()["usage"], as_string.json()["usage"]
    assert (usage["input_tokens"] + usage["cache_read_input_tokens"]
            == usage_s["input_tokens"] + usage_s["cache_read_input_tokens"])


def test_claude_code_tool_conversation(live: LiveServer, client: anthropic.Anthropic) -> None:
    body = message_body(CLAUDE_CODE_MESSAGES, system=SYSTEM_BLOCKS, tools=TOOLS,
                        tool_choice={"type": "auto"}, max_tokens=8)
    r = post(live.url, body)
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert_well_formed(sse_events(live.url, body))
    # the SDK sends the same thing
    msg = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, system=SYSTEM_BLOCKS,  # type: ignore[arg-type]
                                 tools=TOOLS, messages=CLAUDE_CODE_MESSAGES)  # type: ignore[arg-type]
    assert msg.stop_reason is not None
    # tools are part of the prompt, and "none" leaves them out
    with_tools = client.messages.count_tokens(model=MODEL, messages=CLAUDE_CODE_MESSAGES,  # type: ignore[arg-type]
                                              tools=TOOLS).input_tokens  # type: ignore[arg-type]
    without = client.messages.count_tokens(model=MODEL, messages=CLAUDE_CODE_MESSAGES,  # type: ignore[arg-type]
                                           tools=TOOLS, tool_choice={"type": "none"}).input_tokens  # type: ignore[arg-type]
    assert with_tools > without > 0


def test_image_block(live: LiveServer, client: anthropic.Anthropic) -> None:
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64(1)}},
               {"type": "text", "text": "What is in this picture?"}]
    msg = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": content}])  # type: ignore[list-item]
    text_only = client.messages.count_tokens(model=MODEL, messages=user("What is in this picture?"))  # type: ignore[arg-type]
    prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    assert prompt > text_only.input_tokens + 2  # the image was expanded into its patch tokens
    bad = message_body([{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "not-base64!"}}]}])
    r = post(live.url, bad)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_equals_the_prompt_of_the_same_request(live: LiveServer, client: anthropic.Anthropic) -> None:
    for kwargs in ({"messages": user("Count me")},
                   {"messages": CLAUDE_CODE_MESSAGES, "system": SYSTEM_BLOCKS, "tools": TOOLS}):
        counted = client.messages.count_tokens(model=MODEL, **kwargs).input_tokens  # type: ignore[arg-type]
        assert isinstance(counted, int) and counted > 0
        usage = client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, **kwargs).usage  # type: ignore[arg-type]
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
    raw = post(live.url, {"model": MODEL, "messages": user("Count me")}, "/v1/messages/count_tokens")
    assert raw.status_code == 200 and set(raw.json()) == {"input_tokens"}


def test_thinking_enabled_and_disabled(live: LiveServer, client: anthropic.Anthropic) -> None:
    for thinking in ({"type": "enabled", "budget_tokens": 8}, {"type": "disabled"}, {"type": "adaptive"}):
        body = message_body("Think about 2 + 2", max_tokens=16, thinking=thinking)
        r = post(live.url, body)
        assert r.status_code == 200, r.text
        msg = r.json()
        kinds = [b["type"] for b in msg["content"]]
        assert set(kinds) <= {"thinking", "text"}
        for block in msg["content"]:
            if block["type"] == "thinking":
                assert block["signature"] and isinstance(block["thinking"], str) and block["thinking"]
        assert assert_well_formed(sse_events(live.url, body)) == msg["content"]
    # a previous turn's thinking block, signature and all, is accepted back
    msg = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY,
                                 thinking={"type": "enabled", "budget_tokens": 1024},
                                 messages=CLAUDE_CODE_MESSAGES)  # type: ignore[arg-type]
    assert msg.stop_reason is not None


def test_prefix_cache_reads_are_reported(live: LiveServer) -> None:
    system = " ".join(f"Rule {i}: keep answers short, precise and about the repository." for i in range(40))
    first = post(live.url, message_body("What is MLX?", system=system, max_tokens=4)).json()["usage"]
    second = post(live.url, message_body("And what is a KV cache?", system=system, max_tokens=4)).json()["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert second["cache_read_input_tokens"] > 256  # the system prompt came from the prefix cache
    counted = post(live.url, {"model": MODEL, "system": system, "messages": user("And what is a KV cache?")},
                   "/v1/messages/count_tokens").json()["input_tokens"]
    assert second["input_tokens"] + second["cache_read_input_tokens"] == counted
    assert second["cache_creation_input_tokens"] == 0


HI = b'"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize(
    ("body", "status", "kind", "also_count_tokens"),
    [
        (b"{not json", 400, "invalid_request_error", True),
        (b'{"model": "tiny", ' + HI + b"}", 400, "invalid_request_error", False),  # no max_tokens
        (b'{"model": "tiny", "max_tokens": 4}', 400, "invalid_request_error", True),
        (b'{"model": "tiny", "max_tokens": 4, "messages": []}', 400, "invalid_request_error", True),
        (b'{"model": "tiny", "max_tokens": 0, ' + HI + b"}", 400, "invalid_request_error", False),
        (b'{"model": "tiny", "max_tokens": "four", ' + HI + b"}", 400, "invalid_request_error", False),
        (b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}',
         400, "invalid_request_error", True),
        (b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}',
         400, "invalid_request_error", True),
        (b'{"model": "tiny", "max_tokens": 4, ' + HI + b', "tool_choice": {"type": "any"}}',
         400, "invalid_request_error", True),
        (b'{"model": "claude-sonnet-4-5", "max_tokens": 4, ' + HI + b"}", 404, "not_found_error", True),
    ],
)
def test_errors_in_anthropic_shape(live: LiveServer, body: bytes, status: int, kind: str,
                                   also_count_tokens: bool) -> None:
    paths = ["/v1/messages", "/v1/messages/count_tokens"] if also_count_tokens else ["/v1/messages"]
    for path in paths:
        r = local_http.post(live.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, (path, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]
        assert set(err) == {"type", "error"}


def test_a_stop_sequence_inside_one_tokens_text_is_reported(live: LiveServer) -> None:
    """The engine cuts the text at the stop string wherever it falls (here inside a token's text)
    and says which one matched: `stop_reason: "stop_sequence"` with the string, streamed or not."""
    body = message_body(max_tokens=16, thinking={"type": "disabled"})
    [block] = post(live.url, body).json()["content"]
    text = block["text"]
    at = next(i for i in range(1, len(text) - 2)
              if text[i - 1:i + 2].isalpha() and text.find(text[i:i + 2]) == i)  # mid-word: likely inside a token
    stop = text[at:at + 2]
    msg = post(live.url, body | {"stop_sequences": ["never written", stop]}).json()
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", stop)
    assert "".join(b["text"] for b in msg["content"]) == text[:at]
    events = sse_events(live.url, body | {"stop_sequences": [stop]})
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


def test_sdk_raises_typed_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=user("hi"))  # type: ignore[arg-type]
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[])


# -- one slot, no queue: refusals and disconnects --------------------------------------------------


@pytest.fixture(scope="module")
def one_slot(fp32_model: Path) -> Iterator[LiveServer]:
    config = default_config(fp32_model, served_model_name=MODEL, max_num_seqs=1, max_queue=0)
    with LiveServer(config) as server:
        yield server


LONG = {"max_tokens": 4000, "temperature": 0.7}


def running(url: str) -> int:
    return int(local_http.get(url + "/health").json()["running"])


def wait_idle(url: str) -> None:
    deadline = time.monotonic() + 10
    while running(url) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running(url) == 0


def test_stream_disconnect_cancels_the_generation(one_slot: LiveServer) -> None:
    with local_http.stream("POST", one_slot.url + "/v1/messages", json=message_body("go on", stream=True, **LONG),
                      timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines) == "event: message_start"
        assert running(one_slot.url) == 1
        # the only slot is taken and there is no queue: 429 in Anthropic's shape, with Retry-After
        busy = post(one_slot.url, message_body("hi", max_tokens=2))
        assert busy.status_code == 429 and int(busy.headers["Retry-After"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
    # leaving the block closed the connection mid-stream: the generation is cancelled, the slot free
    wait_idle(one_slot.url)
    assert post(one_slot.url, message_body("hi", max_tokens=2)).status_code == 200


def test_non_stream_disconnect_cancels_the_generation(one_slot: LiveServer) -> None:
    body = json.dumps(message_body("go", **LONG)).encode()
    port = int(one_slot.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while running(one_slot.url) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running(one_slot.url) == 1
    wait_idle(one_slot.url)
    assert post(one_slot.url, message_body("hi", max_tokens=2)).status_code == 200


# -- the translation layer alone, on a scripted reply -------------------------------------------


class ScriptedService:
    """Stands in for `ChatService`: replays reply events (an exception in the script is raised
    from the stream) and records the requests it got."""

    def __init__(self, script: list[ReplyEvent | Exception], *, refuse: Exception | None = None,
                 delay_s: float = 0.0) -> None:
        self.script = script
        self.refuse = refuse
        self.delay_s = delay_s
        self.requests: list[ChatRequest] = []
        self.closed = 0

    @asynccontextmanager
    async def reply(self, req: ChatRequest, request_id: str | None = None, *, admitted: bool = False,
                    raw: bool = False, tally: ReplyTally | None = None) -> AsyncIterator[AsyncIterator[ReplyEvent]]:
        if self.refuse is not None:
            raise self.refuse
        self.requests.append(req)
        try:
            yield self._events()
        finally:
            self.closed += 1

    async def _events(self) -> AsyncIterator[ReplyEvent]:
        for item in self.script:
            await anyio.sleep(self.delay_s)
            if isinstance(item, Exception):
                raise item
            yield item

    async def count_tokens(self, req: ChatRequest) -> int:
        if self.refuse is not None:
            raise self.refuse
        return 42


class ScriptedServed:
    """What the routes ask of the app's `Served` (the model check and the model in use), over the
    scripted service."""

    def __init__(self, service: ScriptedService) -> None:
        self.service = service

    def resolve(self, model: str | None) -> str:
        if model in (None, MODEL):
            return MODEL
        raise ModelNotFound(f"no model {model}", param="model")

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ScriptedService]:
        yield self.service


def scripted_app(service: ScriptedService, keepalive_s: float = 10.0) -> Starlette:
    """The Anthropic routes alone, over the scripted service."""
    config = default_config("unused", served_model_name=MODEL, sse_keepalive_s=keepalive_s)
    served = ScriptedServed(service)
    return Starlette(routes=anthropic_routes(config, lambda: served))  # type: ignore[arg-type,return-value]


def scripted_client(service: ScriptedService, keepalive_s: float = 10.0) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=scripted_app(service, keepalive_s))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def frames(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in text.split("\n\n"):
        lines = [ln for ln in frame.split("\n") if ln and not ln.startswith(":")]
        if lines:
            assert lines[0].startswith("event: ") and lines[1].startswith("data: ") and len(lines) == 2
            out.append((lines[0][len("event: "):], json.loads(lines[1][len("data: "):])))
    return out


TOOL_REPLY: list[ReplyEvent | Exception] = [
    ReasoningDelta("The user wants "), ReasoningDelta("the file."),
    ContentDelta("Reading it."),
    ToolCallStart(0, "call_a", "read_file"),
    ToolCallArguments(0, '{"path": '), ToolCallArguments(0, '"main.py"'),
    ToolCallEnd(0, "call_a", "read_file", '{"path": "main.py"}'),
    ToolCallStart(1, "call_b", "bash"),  # no fragments: the whole object comes with the end
    ToolCallEnd(1, "call_b", "bash", '{"command": "ls"}'),
    ReplyDone("tool_calls", prompt_tokens=30, completion_tokens=12, cached_tokens=10),
]


async def test_tool_calls_non_stream_and_stream() -> None:
    service = ScriptedService(TOOL_REPLY)
    async with scripted_client(service) as http:
        body = message_body("read main.py", tools=TOOLS)
        msg = (await http.post("/v1/messages", json=body)).json()
        assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use", "tool_use"]
        assert msg["content"][0]["thinking"] == "The user wants the file." and msg["content"][0]["signature"]
        assert msg["content"][2] == {"type": "tool_use", "id": "call_a", "name": "read_file",
                                     "input": {"path": "main.py"}}
        assert msg["content"][3]["input"] == {"command": "ls"}
        assert msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
        assert msg["usage"] == {"input_tokens": 20, "output_tokens": 12, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 10}
        r = await http.post("/v1/messages", json=body | {"stream": True})
        events = [data for _, data in frames(r.text)]
        assert assert_well_formed(events) == msg["content"]
        assert events[-2]["usage"] == msg["usage"] and events[-2]["delta"]["stop_reason"] == "tool_use"
    # the SDK (on its own httpx2 client) accumulates the same message from the stream
    transport = httpx2.ASGITransport(app=scripted_app(service))
    async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http2:
        sdk = anthropic.AsyncAnthropic(base_url="http://test", api_key="x", max_retries=0, http_client=http2)
        async with sdk.messages.stream(model=MODEL, max_tokens=12, messages=user("read main.py")) as stream:
            final = await stream.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == msg["content"]
    assert final.usage.input_tokens == 20 and final.usage.cache_read_input_tokens == 10
    assert final.stop_reason == "tool_use"
    assert service.closed == 3  # every reply's context was left


async def test_stop_sequence_and_max_tokens() -> None:
    for done, reason, seq in [
        (ReplyDone("stop", 5, 3, stop_sequence="END"), "stop_sequence", "END"),
        (ReplyDone("stop", 5, 3), "end_turn", None),
        (ReplyDone("length", 5, 3), "max_tokens", None),
    ]:
        async with scripted_client(ScriptedService([ContentDelta("abc"), done])) as http:
            msg = (await http.post("/v1/messages", json=message_body(stop_sequences=["END"]))).json()
            assert (msg["stop_reason"], msg["stop_sequence"]) == (reason, seq)
            r = await http.post("/v1/messages", json=message_body(stop_sequences=["END"], stream=True))
            delta = frames(r.text)[-2][1]
            assert delta["delta"] == {"stop_reason": reason, "stop_sequence": seq}


async def test_error_after_the_stream_started_is_an_error_event() -> None:
    script: list[ReplyEvent | Exception] = [ContentDelta("par"), GenerationFailed("the engine failed")]
    async with scripted_client(ScriptedService(script)) as http:
        r = await http.post("/v1/messages", json=message_body(stream=True))
        assert r.status_code == 200
        got = frames(r.text)
        assert [name for name, _ in got] == ["message_start", "ping", "content_block_start",
                                             "content_block_delta", "error"]
        assert got[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}}
        r = await http.post("/v1/messages", json=message_body())
        assert r.status_code == 500
        assert r.json()["error"] == {"type": "api_error", "message": "the engine failed"}


async def test_keep_alives_while_waiting_do_not_end_the_reply() -> None:
    script: list[ReplyEvent | Exception] = [ContentDelta("slow"), ContentDelta(" reply"), ReplyDone("stop", 4, 2)]
    async with scripted_client(ScriptedService(script, delay_s=0.15), keepalive_s=0.05) as http:
        r = await http.post("/v1/messages", json=message_body(stream=True))
        assert ": keep-alive\n\n" in r.text
        blocks = assert_well_formed([data for _, data in frames(r.text)])
        assert blocks == [{"type": "text", "text": "slow reply"}]


@pytest.mark.parametrize(
    ("refusal", "status", "kind", "retry_after"),
    [
        (Overloaded("queue full", retry_after_s=3), 429, "rate_limit_error", "3"),
        (NotReady("warming up", retry_after_s=5), 503, "overloaded_error", "5"),
        (RuntimeError("boom"), 500, "api_error", None),
    ],
)
async def test_refusals_map_to_anthropic_errors(refusal: Exception, status: int, kind: str,
                                                retry_after: str | None) -> None:
    async with scripted_client(ScriptedService([], refuse=refusal)) as http:
        for stream in (False, True):
            r = await http.post("/v1/messages", json=message_body(stream=stream))
            assert r.status_code == status
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind
            assert r.headers.get("retry-after") == retry_after


# Claude Code's readings of Anthropic's two overflow sentences (it lowers max_tokens and retries,
# or compacts): the wording must match exactly
OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), "
                      r"decrease input length or `max_tokens` and try again")
TOO_LONG = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")


async def test_context_overflows_in_anthropics_words() -> None:
    """The errors carry their numbers; this route words them as Anthropic does (the OpenAI routes
    keep their own message and `context_length_exceeded`)."""
    no_room = MaxTokensExceedContext("max_tokens is 32000 ...", prompt_tokens=28834, max_tokens=32000,
                                     context_length=32768)
    too_long = PromptTooLong("the prompt has 41387 tokens ...", prompt_tokens=41387, limit=32767)
    for refusal, pattern, numbers in [(no_room, OVERFLOW, (28834, 32000, 32768)), (too_long, TOO_LONG, (41387, 32767))]:
        async with scripted_client(ScriptedService([], refuse=refusal)) as http:
            paths = ["/v1/messages"] if refusal is no_room else ["/v1/messages", "/v1/messages/count_tokens"]
            for path in paths:
                for stream in (False, True):
                    r = await http.post(path, json=message_body(max_tokens=32000, stream=stream))
                    assert r.status_code == 400, r.text
                    error = r.json()["error"]
                    assert error["type"] == "invalid_request_error"
                    match = pattern.fullmatch(error["message"])
                    assert match is not None and tuple(map(int, match.groups())) == numbers, error


async def test_a_malformed_tool_call_reaches_the_client_as_written() -> None:
    """What the parser makes of a model's wrong calls (an undeclared tool, arguments off the
    schema) streams as tool_use blocks, as written, and the reply ends normally."""
    tools = [ToolDef(FunctionDef("read_file", parameters=TOOLS[0]["input_schema"]))]
    parser = ReplyParser(tools=tools)
    text = ("On it.\n<tool_call>\n<function=delete_all>\n<parameter=force>\ntrue\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=read_file>\n<parameter=limit>\n5\n</parameter>\n</function>\n"
            "</tool_call>")
    script: list[ReplyEvent | Exception] = [*parser.feed(text), *parser.finish(), ReplyDone("tool_calls", 20, 9)]
    async with scripted_client(ScriptedService(script)) as http:
        msg = (await http.post("/v1/messages", json=message_body(tools=TOOLS))).json()
        assert [(b["type"], b.get("name"), b.get("input")) for b in msg["content"]] == [
            ("text", None, None), ("tool_use", "delete_all", {"force": "true"}),
            ("tool_use", "read_file", {"limit": "5"})]
        assert msg["stop_reason"] == "tool_use"
        r = await http.post("/v1/messages", json=message_body(tools=TOOLS, stream=True))
        events = [data for _, data in frames(r.text)]
        assert assert_well_formed(events) == msg["content"] and events[-1]["type"] == "message_stop"


def test_request_conversion() -> None:
    import msgspec

    body = msgspec.json.decode(json.dumps(message_body(
        CLAUDE_CODE_MESSAGES, system=SYSTEM_BLOCKS, tools=[*TOOLS, {"type": "web_search_20250305", "name": "web"}],
        tool_choice={"type": "tool", "name": "bash", "disable_parallel_tool_use": True},
        stop_sequences=["###"], top_k=5,
    )), type=MessagesRequest)
    req = to_chat_request(body)
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assert req.messages[0].content == "You are a coding agent.\n\nUse the tools when they help."
    assistant = req.messages[2]
    assert assistant.content == "Let me look." and assistant.reasoning_content == "I should read the file."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in assistant.tool_calls or []] == [
        ("toolu_01", "read_file", {"path": "main.py"}), ("toolu_02", "bash", {"command": "ls"})]
    assert (req.messages[3].tool_call_id, req.messages[3].name, req.messages[3].content) == (
        "toolu_01", "read_file", "print('hi')")
    assert req.messages[4].content == "Error: ls: permission denied" and req.messages[4].name == "bash"
    assert [t.function.name for t in req.tools or []] == ["read_file", "bash"]  # the server tool is left out
    assert req.tools and req.tools[0].function.parameters == TOOLS[0]["input_schema"]
    assert req.tool_choice == NamedToolChoice("bash") and req.parallel_tool_calls is False
    assert (req.enable_thinking, req.thinking_budget) == (False, None)  # forced tool use: no extended thinking
    thinking = msgspec.structs.replace(body, tool_choice=None, thinking=ThinkingEnabled(budget_tokens=2048))
    assert (to_chat_request(thinking).enable_thinking, to_chat_request(thinking).thinking_budget) == (True, 2048)
    with pytest.raises(InvalidRequest, match="forces tool use"):  # Anthropic's rule
        to_chat_request(msgspec.structs.replace(thinking, tool_choice=body.tool_choice))
    assert (req.stop, req.top_k, req.max_tokens, req.temperature) == (("###",), 5, 12, 0)
    image = msgspec.json.decode(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}]}],
        "tool_choice": {"type": "any"}, "tools": TOOLS[:1], "thinking": {"type": "disabled"}}), type=CountTokensRequest)
    req = to_chat_request(image)
    parts = req.messages[0].content
    assert isinstance(parts, list) and isinstance(parts[0], TextPart)
    assert [p.url for p in parts if isinstance(p, ImageUrlPart)] == ["https://example.com/a.png",
                                                                    "data:image/jpeg;base64,AAAA"]
    assert req.tool_choice == "required" and req.enable_thinking is False and req.max_tokens is None

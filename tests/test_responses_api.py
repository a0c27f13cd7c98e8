"""OpenAI Responses API (`/v1/responses`) over real HTTP on the float32 tiny model, with the
official `openai` SDK and raw SSE; plus unit tests of the item translation, the event assembly
and the bounded response store.

A random-weight model never calls tools by itself: tool calls are exercised through the
assembler with synthetic reply events, and over HTTP only as input (a Codex-shaped history).
"""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import openai
import pytest
from anyio.abc import ObjectSendStream

from mlx_relay.chat.output import (
    ContentDelta,
    ReasoningDelta,
    ReplyDone,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
)
from mlx_relay.chat.types import ImageUrlPart, NamedToolChoice, TextPart
from mlx_relay.errors import GenerationFailed, InvalidRequest
from mlx_relay.http.formats.responses.encoder import ResponseAssembler, sse_frame
from mlx_relay.http.formats.responses.request import items_to_messages, output_messages, parse_items, thinking
from mlx_relay.http.formats.responses.store import ResponseStore
from mlx_relay.http.formats.responses.tools import parse_tool_choice, parse_tools
from mlx_relay.http.formats.responses.types import (
    FunctionToolChoice,
    ReasoningConfig,
    ResponseObject,
    TextConfig,
    TextFormat,
)
from mlx_relay.http.replies import Item
from mlx_relay.http.streaming import ScopedStreamingResponse, sse_body
from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
        "additionalProperties": False,
    },
}

CODEX_INPUT: list[dict[str, Any]] = [
    {"type": "message", "role": "developer",
     "content": [{"type": "input_text", "text": "<permissions>sandbox: workspace-write</permissions>"}]},
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "<environment_context>cwd: /repo</environment_context>"}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
    {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "I should run ls."}],
     "content": None, "encrypted_content": None},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
     "arguments": json.dumps({"command": ["ls"]})},
    {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc\n"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "There are two entries.", "annotations": []}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. And in src?"}]},
]


@pytest.fixture(scope="module")
def live(fp32_model: Path) -> Iterator[LiveServer]:
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=4, max_queue=16)
    with LiveServer(config) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(live: LiveServer, body: dict[str, Any], path: str = "/v1/responses") -> httpx.Response:
    return local_http.post(live.url + path, json={"model": "tiny", "temperature": 0, **body}, timeout=120)


def raw_sse(live: LiveServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) per frame; checks the framing: `event:` names the data's type."""
    frames: list[tuple[str, dict[str, Any]]] = []
    body = {"model": "tiny", "temperature": 0, "stream": True, **body}
    with local_http.stream("POST", live.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name: str | None = None
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            if line.startswith("event: "):
                assert name is None, "an event line without data"
                name = line[len("event: "):]
                continue
            assert line.startswith("data: ") and name is not None, line
            data = json.loads(line[len("data: "):])
            assert data["type"] == name
            frames.append((name, data))
            name = None
    return frames


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Checks a stream's event order (as dicts) and returns the final response.

    created, in_progress; then per output item: output_item.added, (content_part.added, deltas,
    *.done, content_part.done | arguments deltas, arguments.done), output_item.done, items never
    interleaving (on failure the last one may stay unfinished); then exactly one terminal event,
    last. Deltas add up to the done texts and the
    final response's output equals the done items."""
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert types[-1] in ("response.completed", "response.incomplete", "response.failed"), types
    assert sum(t in ("response.completed", "response.incomplete", "response.failed") for t in types) == 1
    rid = events[0]["response"]["id"]
    assert events[0]["response"]["status"] == "in_progress" and events[-1]["response"]["id"] == rid
    done_items: list[dict[str, Any]] = []
    i = 2
    while i < len(events) - 1:
        added = events[i]
        assert added["type"] == "response.output_item.added", types[i:]
        index, item = added["output_index"], added["item"]
        assert index == len(done_items)
        body: list[dict[str, Any]] = []
        i += 1
        while events[i]["type"] != "response.output_item.done":
            if i == len(events) - 1:  # a failed reply leaves its last item unfinished (and not in the output)
                assert types[-1] == "response.failed"
                return events[-1]["response"]
            assert events[i]["type"] != "response.output_item.added", "items interleave"
            assert events[i]["output_index"] == index and events[i]["item_id"] == item["id"]
            body.append(events[i])
            i += 1
        done = events[i]["item"]
        assert events[i]["output_index"] == index and done["id"] == item["id"] and done["type"] == item["type"]
        body_types = [e["type"] for e in body]
        if item["type"] in ("message", "reasoning"):
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            assert body_types[0] == "response.content_part.added" and body_types[-1] == "response.content_part.done"
            assert body_types[-2] == f"response.{kind}.done"
            assert set(body_types[1:-2]) <= {f"response.{kind}.delta"}
            text = "".join(e["delta"] for e in body[1:-2])
            assert body[-2]["text"] == text == done["content"][0]["text"] == body[-1]["part"]["text"]
            assert done["content"][0]["type"] == kind
        else:
            assert item["type"] == "function_call" and body_types[-1] == "response.function_call_arguments.done"
            assert set(body_types[:-1]) <= {"response.function_call_arguments.delta"}
            assert body[-1]["arguments"] == done["arguments"]
            assert done["call_id"] == item["call_id"] and done["name"] == item["name"]
        done_items.append(done)
        i += 1
    final = events[-1]["response"]
    assert final["output"] == done_items
    return final


# --------------------------------------------------------------------------------------------
# Over HTTP
# --------------------------------------------------------------------------------------------


def test_string_input(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete") and r.error is None
    assert r.usage is not None and 0 < r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    for item in r.output:
        assert item.type in ("message", "reasoning")
        if item.type == "message":
            assert item.id.startswith("msg_") and item.role == "assistant"
            assert item.content[0].type == "output_text"
    assert isinstance(r.output_text, str)
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert r.text is not None and r.text.format is not None and r.text.format.type == "text"
    assert r.max_output_tokens == 8 and r.store is True


def test_list_input_with_instructions_and_developer_item(client: openai.OpenAI) -> None:
    plain = client.responses.create(model="tiny", input="Say hi.", max_output_tokens=4, temperature=0)
    r = client.responses.create(
        model="tiny",
        instructions="You are a terse assistant.",
        input=[
            {"type": "message", "role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]},
        ],
        max_output_tokens=4,
        temperature=0,
        metadata={"run": "1"},
    )
    assert r.status in ("completed", "incomplete") and r.instructions == "You are a terse assistant."
    assert r.metadata == {"run": "1"}
    assert r.usage is not None and plain.usage is not None
    assert r.usage.input_tokens > plain.usage.input_tokens  # the system text went into the prompt


def test_streaming_event_order_with_the_sdk(client: openai.OpenAI) -> None:
    stream = client.responses.create(model="tiny", input="Write a haiku", max_output_tokens=6, temperature=0,
                                     stream=True)
    events = [e.model_dump(mode="json", exclude_none=False) for e in stream]
    final = check_stream(events)
    assert final["status"] == "incomplete" and final["usage"]["output_tokens"] == 6
    assert [e["type"] for e in events][2:5] == ["response.output_item.added", "response.content_part.added",
                                                "response.output_text.delta"]
    # the SDK's stream helper (it checks item identities as it accumulates) takes the stream too
    with client.responses.stream(model="tiny", input="Write a haiku", max_output_tokens=6, temperature=0) as s:
        helper = [e.type for e in s]
    assert helper == [e["type"] for e in events]


def test_streaming_raw_sse_with_reasoning(live: LiveServer) -> None:
    frames = raw_sse(live, {"input": "hi", "max_output_tokens": 5, "reasoning": {"effort": "high"}})
    final = check_stream([data for _, data in frames])
    # thinking is on: the prompt ends inside the think block, so the reply starts as reasoning
    assert final["output"][0]["type"] == "reasoning" and final["output"][0]["id"].startswith("rs_")
    assert final["reasoning"] == {"effort": "high"}
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}


def test_codex_shaped_conversation_with_function_tools(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.responses.create(
        model="tiny",
        instructions="You are Codex, a coding agent.",
        input=CODEX_INPUT,  # type: ignore[arg-type]
        tools=[SHELL_TOOL],  # type: ignore[list-item]
        tool_choice="auto",
        parallel_tool_calls=False,
        max_output_tokens=4,
        temperature=0,
        store=False,
    )
    assert r.status in ("completed", "incomplete")
    assert [t.name for t in r.tools] == ["shell"] and r.parallel_tool_calls is False  # type: ignore[union-attr]
    # as Codex sends it: streamed, not stored, with fields we ignore
    frames = raw_sse(live, {
        "instructions": "You are Codex, a coding agent.", "input": CODEX_INPUT, "tools": [SHELL_TOOL],
        "tool_choice": "auto", "parallel_tool_calls": False, "store": False, "max_output_tokens": 4,
        "reasoning": {"effort": "minimal", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1", "text": {"verbosity": "low"}, "service_tier": "auto",
    })
    final = check_stream([data for _, data in frames])
    assert final["store"] is False and final["prompt_cache_key"] == "session-1"
    # the nested Chat Completions tool shape is accepted too
    nested = {"type": "function", "function": {k: v for k, v in SHELL_TOOL.items() if k != "type"}}
    r2 = post(live, {"input": "hi", "tools": [nested], "tool_choice": "none", "max_output_tokens": 2})
    assert r2.status_code == 200, r2.text
    assert r2.json()["tools"][0]["name"] == "shell" and r2.json()["tool_choice"] == "none"


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, live: LiveServer) -> None:
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    alone = client.responses.create(model="tiny", input="What is my name?", max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    assert first.usage and second.usage and alone.usage
    # the second prompt holds the first turn: the first input and its answer
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    # the chain goes on
    third = client.responses.create(model="tiny", input="And again?", previous_response_id=second.id,
                                    max_output_tokens=2, temperature=0, stream=True)
    final = check_stream([e.model_dump(mode="json") for e in third])
    assert final["usage"]["input_tokens"] > second.usage.input_tokens
    # stored responses can be read back and deleted
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    r = local_http.delete(live.url + f"/v1/responses/{first.id}")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_unknown_previous_response_id_is_an_openai_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert "resp_nope" in error["message"] and error["type"] == "invalid_request_error"


def test_store_false_cannot_be_continued(client: openai.OpenAI, live: LiveServer) -> None:
    r = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2, temperature=0)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="again", previous_response_id=r.id, max_output_tokens=2)
    assert local_http.get(live.url + f"/v1/responses/{r.id}").status_code == 404
    # streamed with store false: not stored either
    frames = raw_sse(live, {"input": "hi", "store": False, "max_output_tokens": 2})
    rid = frames[-1][1]["response"]["id"]
    assert local_http.get(live.url + f"/v1/responses/{rid}").status_code == 404
    # streamed and stored: stored
    frames = raw_sse(live, {"input": "hi", "max_output_tokens": 2})
    rid = frames[-1][1]["response"]["id"]
    assert local_http.get(live.url + f"/responses/{rid}").json()["id"] == rid


def test_max_output_tokens_cut_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="Tell me a long story", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output and r.output[-1].status == "incomplete"  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "named"), [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input_file"),
    ({"input": "hi", "tools": [{"type": "shell_v9"}]}, "shell_v9"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [SHELL_TOOL]}, "nope"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "image_url"),
])
def test_bad_requests_are_400(live: LiveServer, body: dict[str, Any], named: str) -> None:
    r = post(live, {**body, "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and named in error["message"]


def test_other_errors_have_the_openai_shape(live: LiveServer, client: openai.OpenAI) -> None:
    r = local_http.post(live.url + "/v1/responses", content=b"{nope", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = post(live, {"input": 5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "input"
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="other", input="hi")
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    unknown_fields = post(live, {"input": "hi", "max_output_tokens": 1, "frobnicate": True, "truncation": "auto"})
    assert unknown_fields.status_code == 200


def test_streaming_disconnect_cancels_the_generation(live: LiveServer) -> None:
    body = {"model": "tiny", "input": "go", "max_output_tokens": 4000, "temperature": 0.7, "stream": True}
    with local_http.stream("POST", live.url + "/v1/responses", json=body, timeout=60) as r:
        lines = r.iter_lines()
        while "response.output_text.delta" not in next(lines):
            pass
        assert local_http.get(live.url + "/health").json()["running"] == 1
    _wait_idle(live)


def test_non_streaming_disconnect_cancels_the_generation(live: LiveServer) -> None:
    body = json.dumps({"model": "tiny", "input": "go", "max_output_tokens": 4000, "temperature": 0.7}).encode()
    host, port = "127.0.0.1", int(live.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while local_http.get(live.url + "/health").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local_http.get(live.url + "/health").json()["running"] == 1
    _wait_idle(live)


def _wait_idle(live: LiveServer) -> None:
    deadline = time.monotonic() + 10
    while local_http.get(live.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local_http.get(live.url + "/health").json()["running"] == 0


# --------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------


def test_items_to_messages() -> None:
    items = parse_items([
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                      "detail": "low"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "I will run it."}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "summary"}]},
        {"type": "function_call", "call_id": "c3", "name": "shell", "arguments": "{}"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
    ])
    msgs = items_to_messages(items)
    assert [m.role for m in msgs] == ["developer", "user", "assistant", "tool", "tool", "assistant"]
    user = msgs[1].content
    assert isinstance(user, list) and isinstance(user[0], TextPart) and isinstance(user[1], ImageUrlPart)
    assert user[1].url.startswith("data:image/png") and user[1].image_url.detail == "low"  # type: ignore[union-attr]
    assistant = msgs[2]
    assert assistant.reasoning_content == "think"
    assert isinstance(assistant.content, list) and assistant.content[0].text == "I will run it."  # type: ignore[union-attr]
    assert [c.id for c in assistant.tool_calls or []] == ["c1", "c2"]
    assert assistant.tool_calls and assistant.tool_calls[1].function.arguments == "{\"a\": 1}"
    assert msgs[3].tool_call_id == "c1" and msgs[3].content == "one"
    assert msgs[5].content is None and msgs[5].reasoning_content == "summary"
    assert [c.id for c in msgs[5].tool_calls or []] == ["c3"]
    assert parse_items("hi")[0].role == "user"  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="input\\[0\\]"):
        parse_items([{"type": "function_call", "name": "x"}])  # no call_id


def test_tools_choice_and_thinking() -> None:
    tools, _ = parse_tools([SHELL_TOOL])
    assert tools[0].name == "shell" and tools[0].parameters == SHELL_TOOL["parameters"]
    assert parse_tool_choice(None, tools)[0] == "auto"
    assert parse_tool_choice("none", tools)[0] == "none"
    named, echo = parse_tool_choice({"type": "function", "name": "shell"}, tools)
    assert named == NamedToolChoice("shell") and echo == FunctionToolChoice("shell")
    with pytest.raises(InvalidRequest):
        parse_tool_choice("required", [])
    # Codex's freeform tools become functions with one string input; hosted tools are left out
    [patch], _ = parse_tools([{"type": "custom", "name": "apply_patch"}, {"type": "web_search"}])
    assert patch.name == "apply_patch" and patch.parameters["required"] == ["input"]
    with pytest.raises(InvalidRequest, match="shell_v9"):
        parse_tools([{"type": "shell_v9"}])
    assert thinking(None) is None and thinking(ReasoningConfig()) is None
    assert thinking(ReasoningConfig(effort="minimal")) is False and thinking(ReasoningConfig(effort="none")) is False
    assert thinking(ReasoningConfig(effort="low")) is True and thinking(ReasoningConfig(effort="high")) is True


def _response() -> ResponseObject:
    return ResponseObject(id="resp_x", created_at=0, status="in_progress", model="tiny", output=[],
                          parallel_tool_calls=True, tool_choice="auto", tools=[],
                          text=TextConfig(TextFormat("text")), store=True)


def _dicts(events: list[Any]) -> list[dict[str, Any]]:
    out = []
    for ev in events:
        frame = sse_frame(ev).decode()
        name, data = frame.split("\n")[0], frame.split("\n")[1]
        assert name == f"event: {json.loads(data[6:])['type']}"
        out.append(json.loads(data[6:]))
    return out


def test_assembler_reasoning_text_and_tool_calls() -> None:
    a = ResponseAssembler(_response())
    events = a.start()
    for ev in [ReasoningDelta("hmm"), ReasoningDelta(" ok"), ContentDelta("Let me "), ContentDelta("look."),
               ToolCallStart(0, "call_a", "shell"), ToolCallArguments(0, "{\"command\": "),
               ToolCallArguments(0, "[\"ls\"]}"), ToolCallEnd(0, "call_a", "shell", "{\"command\": [\"ls\"]}"),
               ToolCallStart(1, "call_b", "shell"), ToolCallEnd(1, "call_b", "shell", "{}"),
               ReplyDone("tool_calls", 10, 7, cached_tokens=4, reasoning_tokens=2)]:
        events += a.feed(ev)
    final = check_stream(_dicts(events))
    assert final["status"] == "completed"
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "hmm ok"}]
    assert final["output"][1]["content"][0]["text"] == "Let me look."
    assert final["output"][2]["call_id"] == "call_a" and final["output"][2]["arguments"] == "{\"command\": [\"ls\"]}"
    assert final["output"][2]["id"].startswith("fc_") and final["output"][3]["arguments"] == "{}"
    assert final["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                              "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 2},
                              "total_tokens": 17}
    # the output as the next turn sees it: one assistant message
    [turn] = output_messages(a.response.output)
    assert turn.role == "assistant" and turn.content == "Let me look." and turn.reasoning_content == "hmm ok"
    assert [c.id for c in turn.tool_calls or []] == ["call_a", "call_b"]


def stock_tool(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": f"{name} a stock item",
            "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}}


# Codex's MCP tools: one namespace per server, the inner tools by their own names
NAMESPACED_TOOLS = [
    SHELL_TOOL,
    {"type": "namespace", "name": "mcp__stock", "description": "Stock server",
     "tools": [stock_tool("delete_stock"), stock_tool("add_stock")]},
    {"type": "namespace", "name": "mcp__warehouse", "tools": [stock_tool("delete_stock")]},
    # joins to the same text as mcp__stock + add_stock, and a flat tool takes that text too
    {"type": "namespace", "name": "mcp", "tools": [stock_tool("stock__add_stock")]},
    stock_tool("mcp__stock__add_stock"),
]


def test_namespaced_tools_get_unambiguous_qualified_names() -> None:
    tools, names = parse_tools(NAMESPACED_TOOLS)
    qualified = [t.name for t in tools]
    assert qualified == ["shell", "mcp__stock__delete_stock", "mcp__stock__add_stock_2",
                         "mcp__warehouse__delete_stock", "mcp__stock__add_stock_3", "mcp__stock__add_stock"]
    assert len(set(qualified)) == len(qualified)
    assert names.split("mcp__stock__delete_stock") == ("mcp__stock", "delete_stock")
    assert names.split("mcp__warehouse__delete_stock") == ("mcp__warehouse", "delete_stock")
    assert names.split("mcp__stock__add_stock_3") == ("mcp", "stock__add_stock")
    assert names.split("mcp__stock__add_stock") == (None, "mcp__stock__add_stock")  # the flat tool
    assert names.split("shell") == (None, "shell") and names.split("nope") == (None, "nope")
    # on the way in: a function_call item with a namespace renders under the qualified name
    items = parse_items([
        {"type": "message", "role": "user", "content": "clear it"},
        {"type": "function_call", "call_id": "c1", "namespace": "mcp__warehouse", "name": "delete_stock",
         "arguments": "{\"sku\": \"a\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ])
    [_, turn, _] = items_to_messages(items, names)
    assert [c.function.name for c in turn.tool_calls or []] == ["mcp__warehouse__delete_stock"]
    named, echo = parse_tool_choice({"type": "function", "namespace": "mcp__stock", "name": "add_stock"}, tools, names)
    assert named == NamedToolChoice("mcp__stock__add_stock_2") and echo.name == "add_stock"  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="do not nest"):
        parse_tools([{"type": "namespace", "name": "a", "tools": [{"type": "namespace", "name": "b"}]}])


def test_assembler_answers_namespaced_calls_with_their_namespace() -> None:
    """Streamed and collected alike: the item names the namespace and the inner tool, as Codex
    dispatches it; the stored turn reads as the model wrote it."""
    _, names = parse_tools(NAMESPACED_TOOLS)
    a = ResponseAssembler(_response(), names)
    events = a.start()
    for ev in [ToolCallStart(0, "call_d", "mcp__stock__delete_stock"), ToolCallArguments(0, "{\"sku\":\"a\"}"),
               ToolCallEnd(0, "call_d", "mcp__stock__delete_stock", "{\"sku\":\"a\"}"),
               ToolCallEnd(1, "call_s", "shell", ""), ReplyDone("tool_calls", 9, 4)]:
        events += a.feed(ev)
    dicts = _dicts(events)
    final = check_stream(dicts)
    added = [e["item"] for e in dicts if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in dicts if e["type"] == "response.output_item.done"]
    for items in (added, done, final["output"]):
        assert [(i["type"], i.get("namespace"), i["name"]) for i in items] == [
            ("function_call", "mcp__stock", "delete_stock"), ("function_call", None, "shell")]
    assert [i["arguments"] for i in final["output"]] == ["{\"sku\":\"a\"}", "{}"]  # never ""
    assert "namespace" not in final["output"][1]
    [turn] = output_messages(a.response.output, names)
    assert [c.function.name for c in turn.tool_calls or []] == ["mcp__stock__delete_stock", "shell"]


def test_codex_namespaced_history_renders_and_is_accepted(live: LiveServer) -> None:
    """A Codex turn with MCP namespaces and a namespaced call in its history: accepted, the echo
    lists the tools as the model saw them, and the continuation renders the same as a request
    that names the qualified tools flat (the history is the model's own)."""
    history = [{"type": "message", "role": "user", "content": "drop sku a"},
               {"type": "function_call", "call_id": "c1", "namespace": "mcp__stock", "name": "delete_stock",
                "arguments": "{\"sku\": \"a\"}"},
               {"type": "function_call_output", "call_id": "c1", "output": "deleted"}]
    r = post(live, {"input": history, "tools": NAMESPACED_TOOLS, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    echoed = [t["name"] for t in r.json()["tools"]]
    assert echoed[:3] == ["shell", "mcp__stock__delete_stock", "mcp__stock__add_stock_2"]
    tools, _ = parse_tools(NAMESPACED_TOOLS)
    flat = [msgspec.to_builtins(t) for t in tools]
    flat_history = [history[0], {**history[1], "name": "mcp__stock__delete_stock"}, history[2]]
    del flat_history[1]["namespace"]
    counted = [post(live, {"input": h, "tools": t, "max_output_tokens": 2}).json()["usage"]["input_tokens"]
               for h, t in ((history, NAMESPACED_TOOLS), (flat_history, flat))]
    assert counted[0] == counted[1]


def test_assembler_text_after_reasoning_again_and_failure() -> None:
    a = ResponseAssembler(_response())
    events = a.start()
    for ev in [ContentDelta("a"), ReasoningDelta("b"), ContentDelta("c"), ToolCallStart(0, "call_z", "shell"),
               ToolCallArguments(0, "{\"x\"")]:
        events += a.feed(ev)
    events += a.fail(GenerationFailed("the engine failed"))
    final = check_stream(_dicts(events))
    assert final["status"] == "failed" and final["error"]["code"] == "generation_failed"
    assert [o["type"] for o in final["output"]] == ["message", "reasoning", "message"]


def test_assembler_length_cut_marks_the_open_item_incomplete() -> None:
    a = ResponseAssembler(_response())
    events = a.start() + a.feed(ContentDelta("partial")) + a.feed(ReplyDone("length", 3, 1))
    final = check_stream(_dicts(events))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_a_reply_of_reasoning_alone_still_closes_a_message() -> None:
    """Issue 44.8: a reply cut while it reasons (or that wrote nothing) ends with its message item
    opened and closed, empty, its output_text.done sent; one that called a tool needs none."""
    for fed in ([ReasoningDelta("thinking it over")], []):
        a = ResponseAssembler(_response())
        events = a.start()
        for ev in [*fed, ReplyDone("length", 3, 16, reasoning_tokens=16)]:
            events += a.feed(ev)
        dicts = _dicts(events)
        final = check_stream(dicts)
        assert [o["type"] for o in final["output"]] == ["reasoning"] * len(fed) + ["message"]
        assert final["output"][-1]["content"] == [{"type": "output_text", "text": "", "annotations": [],
                                                   "logprobs": []}]
        assert final["output"][-1]["status"] == "incomplete"
        assert [d["type"] for d in dicts].count("response.output_text.done") == 1
    a = ResponseAssembler(_response())
    events = a.start()
    for ev in [ToolCallStart(0, "call_a", "shell"), ToolCallEnd(0, "call_a", "shell", "{}"),
               ReplyDone("tool_calls", 3, 5)]:
        events += a.feed(ev)
    assert [o["type"] for o in check_stream(_dicts(events))["output"]] == ["function_call"]


def test_response_store_bounds() -> None:
    store: ResponseStore[str] = ResponseStore(max_entries=3, max_bytes=100)
    for key in ("a", "b", "c"):
        assert store.put(key, key, 10)
    assert store.get("a") == "a"  # now the most recently used
    store.put("d", "d", 10)  # four entries: the least recently used ("b") goes
    assert "b" not in store and len(store) == 3 and store.bytes == 30
    store.put("e", "e", 85)  # 115 bytes: "c" and then "a" go
    assert "c" not in store and "a" not in store and "d" in store and "e" in store
    assert store.bytes == 95 and len(store) == 2
    assert not store.put("huge", "x", 101)  # larger than the whole bound: not stored, nothing evicted
    assert "huge" not in store and len(store) == 2
    store.put("d", "d2", 5)  # replacing an entry re-counts its bytes
    assert store.get("d") == "d2" and store.bytes == 90
    assert store.delete("d") and not store.delete("d") and store.bytes == 85
    assert store.get("missing") is None
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)


def _run_sse(spec: str, disconnect_after: int | None, fail_send: bool = False) -> tuple[list[bytes], list[str]]:
    """Runs a ScopedStreamingResponse over the one skeleton (`sse_body`) whose producer sends three
    content events 50 ms apart, then the end (keep-alive every 10 ms); returns the body chunks sent
    and what happened to the producer and the exit stack. `disconnect_after`: the client goes away
    once that many content frames were sent, and the producer then waits for its next event until
    it is cancelled (no race between the disconnect and a send, however loaded the machine)."""
    chunks: list[bytes] = []
    log: list[str] = []
    gone = anyio.Event()

    class Frames:
        done = False

        def start(self) -> list[bytes]:
            return []

        def event(self, index: int, ev: Any) -> list[bytes]:
            self.done = isinstance(ev, ReplyDone)
            return [] if self.done else [b"data: " + ev.text.encode() + b"\n\n"]

        def failed(self, exc: Exception) -> list[bytes]:
            return [b"event: error\n\n"]

        def end(self) -> list[bytes]:
            return []

    async def produce(tx: ObjectSendStream[Item]) -> None:
        try:
            async with tx:
                for i in range(3):
                    await anyio.sleep(0.05)
                    if disconnect_after is not None and i == disconnect_after:
                        await anyio.sleep_forever()  # the next event never comes before the disconnect
                    await tx.send((0, ContentDelta(str(i))))
                await tx.send((0, ReplyDone("stop", 1, 3)))
            log.append("produced")
        except anyio.get_cancelled_exc_class():
            log.append("cancelled")
            raise

    async def receive() -> dict[str, Any]:
        if disconnect_after is None:
            await anyio.sleep_forever()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            if fail_send and len(chunks) == 2:
                raise OSError("connection reset")
            chunks.append(message["body"])
            if disconnect_after is not None and sum(c.startswith(b"data") for c in chunks) == disconnect_after:
                gone.set()

    async def main() -> None:
        stack = AsyncExitStack()
        stack.callback(log.append, "stack closed")
        tx, rx = anyio.create_memory_object_stream[Item](max_buffer_size=64)
        response = ScopedStreamingResponse(sse_body(rx, Frames(), 0.01), stack, functools.partial(produce, tx))
        try:
            await response({"type": "http", "asgi": {"spec_version": spec}}, receive, send)  # type: ignore[arg-type]
        except Exception as exc:
            log.append(type(exc).__name__)

    anyio.run(main)
    return chunks, log


def test_reply_sse_keepalives_and_scope() -> None:
    chunks, log = _run_sse("2.3", None)
    frames = [c for c in chunks if c.startswith(b"data")]
    assert frames == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"] and chunks[-1] == b""
    assert b": keep-alive\n\n" in chunks  # waiting never cancels the producer
    assert log == ["produced", "stack closed"]
    # the client goes away: the producer is cancelled, then the stack (the generation) closed
    chunks, log = _run_sse("2.3", 2)
    assert log == ["cancelled", "stack closed"] and b"data: 2\n\n" not in chunks
    # an ASGI 2.4 server reports the disconnect as an OSError from send
    chunks, log = _run_sse("2.4", None, fail_send=True)
    assert log == ["cancelled", "stack closed", "ClientDisconnect"]

"""Agent request sequences replayed against a live server: the bodies and headers OpenCode, Claude
Code, Codex, Qwen Code and Cline send (as their public issue trackers document them), turn by turn.

Every request must be answered (HTTP 200, never a chat-template error), every stream must be
well formed for its API, and no `<think>`, `</think>`, `<tool_call>` or `<function=` markup may leak
into any text delta. The model is a random-weight tiny model: it never calls a tool on its own, so
nothing here asserts that it does (one request forces a call with a named `tool_choice`, to check
the streamed tool-call deltas AI-SDK clients validate). The trained embedded model's unforced
calls, through OpenCode's and Claude Code's request shapes around prompts it was trained for, are
`tests/test_relay_tiny_agent.py`'s (these clients' own prompts are far outside its training).

The wire details come from `shared/notes/field-notes.md`: system messages in the middle of a
conversation, `[system, system, user, user]`, the `developer` role, `role: "system"` inside
Anthropic `messages` (Claude Code 2.1.154+), a usage chunk only when asked for, exactly one
`finish_reason` then `[DONE]`, an unknown model answered 404 without harming the served one, prefix
reuse across Claude Code turns (the per-request `x-anthropic-billing-header` system block), and
Codex's mixed tool array (function tools next to `namespace`, `web_search` and `custom` ones).
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

MODEL = "tiny"
TIMEOUT = 120
LEAKS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=")
DRAFT7 = "http://json-schema.org/draft-07/schema#"

Json = dict[str, Any]


# =====================================================================================================
# Wire helpers: SSE frames, and per-API checks of streams and non-streamed answers
# =====================================================================================================


def sse_frames(r: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(event name or None, data) per SSE frame; comment lines (keep-alives) are skipped, as clients do."""
    event: str | None = None
    data: list[str] = []
    for line in r.iter_lines():
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        else:
            raise AssertionError(f"unexpected SSE line: {line!r}")
    if data:
        yield event, "\n".join(data)


def assert_no_leak(text: str, where: str) -> None:
    for tag in LEAKS:
        assert tag not in text, f"{tag!r} leaked into {where}: {text!r}"


def assert_ok(r: httpx.Response, what: str) -> None:
    """A 200, and the body of anything else in the failure message (a template error names itself)."""
    if r.status_code != 200:
        body = r.read().decode(errors="replace")
        raise AssertionError(f"{what}: HTTP {r.status_code}: {body}")


def post(server: LiveServer, path: str, body: Json, headers: dict[str, str] | None = None) -> httpx.Response:
    return local_http.post(server.url + path, json=body, headers=headers or {}, timeout=TIMEOUT)


# -- OpenAI Chat Completions ---------------------------------------------------------------------------


@dataclass
class ChatStream:
    chunks: list[Json]
    text: str
    reasoning: str
    finish_reason: str
    usage: Json | None
    calls: dict[int, Json] = field(default_factory=dict)


def check_chat_chunks(frames: list[tuple[str | None, str]], include_usage: bool, model: str = MODEL) -> ChatStream:
    """The stream strict OpenAI clients (the AI SDK, the openai SDKs) accept: chunks with one id, the
    role first, every tool-call delta carrying `index` (and `id`, `type`, `function.name` on a call's
    first delta, arguments as string fragments), exactly one `finish_reason`, a usage-only chunk last
    if and only if `stream_options.include_usage` asked for it, then `data: [DONE]` and nothing else."""
    assert frames, "an empty stream"
    assert frames[-1][1] == "[DONE]", f"the stream must end with data: [DONE], ended with {frames[-1]!r}"
    assert [d for _, d in frames].count("[DONE]") == 1
    chunks = [json.loads(d) for _, d in frames[:-1]]
    assert chunks, "no chunk before [DONE]"
    assert len({c["id"] for c in chunks}) == 1, "every chunk carries the same id"
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == model and isinstance(c["created"], int), c
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and with_choices[0]["choices"][0]["delta"].get("role") == "assistant", chunks[:2]
    texts: list[str] = []
    thoughts: list[str] = []
    finishes: list[str] = []
    calls: dict[int, Json] = {}
    for c in with_choices:
        assert [ch["index"] for ch in c["choices"]] == [0], c
        choice = c["choices"][0]
        assert not finishes, f"a chunk after the finish_reason: {c}"
        delta = choice["delta"]
        for key in ("content", "reasoning_content"):
            value = delta.get(key)
            if value is not None:
                assert isinstance(value, str), delta
                assert_no_leak(value, f"delta.{key}")
        texts.append(delta.get("content") or "")
        thoughts.append(delta.get("reasoning_content") or "")
        for tc in delta.get("tool_calls") or []:
            assert isinstance(tc.get("index"), int), f"a tool_calls delta without index: {tc}"
            args = tc.get("function", {}).get("arguments")
            assert args is None or isinstance(args, str), f"arguments must be string fragments: {tc}"
            if tc["index"] not in calls:
                assert isinstance(tc.get("id"), str) and tc["id"], f"first delta of a call without id: {tc}"
                assert tc.get("type") == "function", f"first delta of a call without type: {tc}"
                assert isinstance(tc["function"].get("name"), str) and tc["function"]["name"], tc
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": args or ""}
            else:
                assert "name" not in tc.get("function", {}), f"a call renamed mid-stream: {tc}"
                calls[tc["index"]]["arguments"] += args or ""
        if choice.get("finish_reason") is not None:
            finishes.append(choice["finish_reason"])
    assert len(finishes) == 1, f"exactly one chunk carries the finish_reason, got {finishes}"
    assert finishes[0] in ("stop", "length", "tool_calls"), finishes
    assert (finishes[0] == "tool_calls") == bool(calls), (finishes, calls)
    for call in calls.values():
        assert isinstance(json.loads(call["arguments"] or "{}"), dict), call
    usage_chunks = [c for c in chunks if c.get("usage")]
    usage = None
    if include_usage:
        assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1], "one usage chunk, the last one"
        assert chunks[-1]["choices"] == []
        usage = chunks[-1]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    else:
        assert not usage_chunks, "a usage chunk nobody asked for (field notes: some clients mishandle it)"
        assert all(c["choices"] for c in chunks), "a choices-less chunk nobody asked for"
    return ChatStream(chunks, "".join(texts), "".join(thoughts), finishes[0], usage, calls)


def chat_stream(server: LiveServer, body: Json, headers: dict[str, str] | None = None,
                what: str = "chat stream") -> ChatStream:
    assert body.get("stream") is True
    with local_http.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers or {},
                      timeout=TIMEOUT) as r:
        assert_ok(r, what)
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = list(sse_frames(r))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return check_chat_chunks(frames, include_usage, body["model"])


def check_chat_completion(body: Json, model: str = MODEL) -> Json:
    assert body["object"] == "chat.completion" and body["model"] == model and body["id"], body
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    msg = choice["message"]
    assert msg["role"] == "assistant"
    assert_no_leak(msg.get("content") or "", "message.content")
    assert_no_leak(msg.get("reasoning_content") or "", "message.reasoning_content")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0
    return msg


# -- Anthropic Messages ----------------------------------------------------------------------------------


@dataclass
class MessageStream:
    events: list[Json]
    blocks: list[Json]
    stop_reason: str
    usage: Json


def check_message_events(frames: list[tuple[str | None, str]], model: str = MODEL) -> MessageStream:
    """Anthropic's order: message_start, then content blocks 0, 1, ... (start, deltas, stop; never
    interleaved), message_delta, message_stop; `ping` may come anywhere after message_start. Every
    frame's `event:` names its data's type."""
    events: list[Json] = []
    for name, data in frames:
        ev = json.loads(data)
        assert name == ev["type"], f"event: {name} carries a {ev['type']}"
        assert ev["type"] != "error", f"an error frame: {ev}"
        events.append(ev)
    core = [e for e in events if e["type"] != "ping"]
    assert events and events[0]["type"] == "message_start", [e["type"] for e in events]
    start = events[0]["message"]
    assert start["type"] == "message" and start["role"] == "assistant" and start["content"] == []
    assert start["model"] == model and start["id"].startswith("msg_") and start["stop_reason"] is None
    assert [e["type"] for e in core[-2:]] == ["message_delta", "message_stop"], [e["type"] for e in core]
    assert events[-1]["type"] == "message_stop", "nothing may follow message_stop"
    blocks: list[Json] = []
    i = 1
    while i < len(core) - 2:
        ev = core[i]
        assert ev["type"] == "content_block_start" and ev["index"] == len(blocks), (i, ev)
        block = copy.deepcopy(ev["content_block"])
        partial = ""
        i += 1
        while core[i]["type"] == "content_block_delta":
            assert core[i]["index"] == ev["index"], "blocks interleave"
            delta = core[i]["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text"
                assert_no_leak(delta["text"], "text_delta")
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking"
                assert_no_leak(delta["thinking"], "thinking_delta")
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert block["type"] == "thinking"
                block["signature"] += delta["signature"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use", delta
                partial += delta["partial_json"]
            i += 1
        assert core[i] == {"type": "content_block_stop", "index": ev["index"]}, core[i]
        i += 1
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial or "{}")
        if block["type"] == "thinking":
            assert block["signature"], "a thinking block needs its signature (clients send it back)"
        blocks.append(block)
    delta = core[-2]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), delta
    usage = delta["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) > 0
    return MessageStream(events, blocks, delta["delta"]["stop_reason"], usage)


def messages_stream(server: LiveServer, body: Json, headers: dict[str, str], what: str = "messages stream",
                    path: str = "/v1/messages?beta=true") -> MessageStream:
    assert body.get("stream") is True
    with local_http.stream("POST", server.url + path, json=body, headers=headers, timeout=TIMEOUT) as r:
        assert_ok(r, what)
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = list(sse_frames(r))
    return check_message_events(frames, body["model"])


def check_message(body: Json, model: str = MODEL) -> Json:
    assert body["type"] == "message" and body["role"] == "assistant" and body["model"] == model, body
    assert body["id"].startswith("msg_")
    assert body["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), body
    for block in body["content"]:
        assert block["type"] in ("text", "thinking", "tool_use"), block
        if block["type"] == "text":
            assert_no_leak(block["text"], "text block")
        elif block["type"] == "thinking":
            assert_no_leak(block["thinking"], "thinking block")
            assert block["signature"]
    usage = body["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    return body


# -- OpenAI Responses --------------------------------------------------------------------------------------


def check_response_events(frames: list[tuple[str | None, str]]) -> Json:
    """created, in_progress, then whole output items one after the other (added, parts and deltas,
    done), then response.completed or response.incomplete, last; sequence numbers 0, 1, 2, ...
    Returns the final response object, whose output equals the items the stream built."""
    events = []
    for name, data in frames:
        ev = json.loads(data)
        assert name == ev["type"], f"event: {name} carries a {ev['type']}"
        events.append(ev)
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert types[-1] in ("response.completed", "response.incomplete"), f"ended with {types[-1]}: {events[-1]}"
    terminal = ("response.completed", "response.incomplete", "response.failed")
    assert sum(t in terminal for t in types) == 1, types
    items: list[Json] = []
    open_item: Json | None = None
    text = ""
    for ev in events[2:-1]:
        kind = ev["type"]
        if kind == "response.output_item.added":
            assert open_item is None, "items interleave"
            assert ev["output_index"] == len(items)
            open_item, text = ev["item"], ""
            continue
        assert open_item is not None, f"{kind} outside an item"
        if kind == "response.output_item.done":
            done = ev["item"]
            assert done["id"] == open_item["id"] and done["type"] == open_item["type"]
            if done["type"] in ("message", "reasoning"):
                assert done["content"][0]["text"] == text
            items.append(done)
            open_item = None
            continue
        assert ev["item_id"] == open_item["id"] and ev["output_index"] == len(items), ev
        if kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            assert_no_leak(ev["delta"], kind)
            text += ev["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert ev["text"] == text
        elif kind == "response.function_call_arguments.done":
            assert isinstance(json.loads(ev["arguments"]), dict)
        else:
            assert kind in ("response.content_part.added", "response.content_part.done",
                            "response.function_call_arguments.delta"), kind
    assert open_item is None, "an item left open"
    final = events[-1]["response"]
    assert final["id"] == events[0]["response"]["id"] and final["status"] in ("completed", "incomplete")
    assert final["output"] == items
    return final


def responses_stream(server: LiveServer, body: Json, headers: dict[str, str], what: str = "responses stream") -> Json:
    assert body.get("stream") is True
    with local_http.stream("POST", server.url + "/v1/responses", json=body, headers=headers, timeout=TIMEOUT) as r:
        assert_ok(r, what)
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = list(sse_frames(r))
    final = check_response_events(frames)
    check_response(final, body["model"])
    return final


def check_response(body: Json, model: str = MODEL) -> Json:
    assert body["object"] == "response" and body["model"] == model and body["id"].startswith("resp_"), body
    assert body["status"] in ("completed", "incomplete") and body["error"] is None, body
    for item in body["output"]:
        assert item["type"] in ("message", "reasoning", "function_call"), item
        if item["type"] == "message":
            assert item["role"] == "assistant"
            for part in item["content"]:
                assert part["type"] == "output_text"
                assert_no_leak(part["text"], "output_text")
        elif item["type"] == "reasoning":
            for part in item["content"]:
                assert_no_leak(part["text"], "reasoning_text")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] and usage["output_tokens"] > 0
    return body


# =====================================================================================================
# OpenCode: OpenAI-compatible chat completions through the AI SDK, streamed with usage
# =====================================================================================================

OPENCODE_HEADERS = {
    "Authorization": "Bearer opencode-local",
    "User-Agent": "opencode/1.0.150 ai-sdk/provider-utils/3.0.9 runtime/bun/1.2.21",
}


def zod_object(properties: Json, required: list[str]) -> Json:
    """A parameter schema as zod-to-json-schema writes it for the AI SDK."""
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
            "$schema": DRAFT7}


OPENCODE_TOOLS: list[Json] = [
    {"type": "function", "function": {
        "name": "bash", "description": "Executes a given bash command in a persistent shell session.",
        "parameters": zod_object({
            "command": {"type": "string", "description": "The command to execute"},
            "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
            "description": {"type": "string", "description": "Clear, concise description of what this command does"},
        }, ["command", "description"])}},
    {"type": "function", "function": {
        "name": "read", "description": "Reads a file from the local filesystem.",
        "parameters": zod_object({
            "filePath": {"type": "string", "description": "The path to the file to read"},
            "offset": {"type": "number", "description": "The line number to start reading from (0-based)"},
            "limit": {"type": "number", "description": "The number of lines to read (defaults to 2000)"},
        }, ["filePath"])}},
    {"type": "function", "function": {
        "name": "edit", "description": "Performs exact string replacements in files.",
        "parameters": zod_object({
            "filePath": {"type": "string", "description": "The absolute path to the file to modify"},
            "oldString": {"type": "string", "description": "The text to replace"},
            "newString": {"type": "string", "description": "The text to replace it with"},
            "replaceAll": {"type": "boolean", "description": "Replace all occurrences of oldString"},
        }, ["filePath", "oldString", "newString"])}},
    {"type": "function", "function": {
        "name": "todowrite", "description": "Use this tool to create and manage a structured task list.",
        "parameters": zod_object({
            "todos": {"type": "array", "description": "The updated todo list", "items": {
                "type": "object", "additionalProperties": False,
                "required": ["content", "status", "priority", "id"],
                "properties": {
                    "content": {"type": "string", "description": "Brief description of the task"},
                    "status": {"type": "string", "enum": ["pending", "in_progress", "completed", "cancelled"]},
                    "priority": {"type": "string", "enum": ["high", "medium", "low"]},
                    "id": {"type": "string", "description": "Unique identifier for the todo item"},
                }}},
        }, ["todos"])}},
    {"type": "function", "function": {
        "name": "todoread", "description": "Use this tool to read your todo list",
        "parameters": zod_object({}, [])}},
    {"type": "function", "function": {
        "name": "task", "description": "Launch a new agent to handle complex, multi-step tasks autonomously.",
        "parameters": zod_object({
            "description": {"type": "string", "description": "A short (3-5 words) description of the task"},
            "prompt": {"type": "string", "description": "The task for the agent to perform"},
            "subagent_type": {"type": "string", "description": "The type of specialized agent to use"},
        }, ["description", "prompt", "subagent_type"])}},
]

OPENCODE_SYSTEM = [
    {"role": "system", "content": (
        "You are opencode, an interactive CLI tool that helps users with software engineering tasks. Use the "
        "instructions below and the tools available to you to assist the user.\n\nIMPORTANT: Refuse to write "
        "code or explain code that may be used maliciously.\n\n# Tone and style\nYou should be concise, direct, "
        "and to the point. When you run a non-trivial bash command, you should explain what the command does.")},
    {"role": "system", "content": (
        "Here is some useful information about the environment you are running in:\n<env>\n  Working directory: "
        "/home/dev/project\n  Is directory a git repo: yes\n  Platform: darwin\n  Today's date: Mon Nov 03 2025\n"
        "</env>\n<project>\n  src/\n  src/main.py\n  tests/\n  README.md\n</project>")},
]


def opencode_body(messages: list[Json], **extra: Any) -> Json:
    return {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": messages, "tools": OPENCODE_TOOLS,
            "tool_choice": "auto", "stream": True, "stream_options": {"include_usage": True}, **extra}


def opencode_session() -> list[list[Json]]:
    """The message lists of four consecutive OpenCode requests, each extending the one before."""
    turn1 = [*OPENCODE_SYSTEM, {"role": "user", "content": [
        {"type": "text", "text": "Why does `python -m pytest` fail in tests/test_main.py?"},
        {"type": "text", "text": "<system-reminder>Plan mode is off. You may edit files.</system-reminder>"}]}]
    turn2 = [*turn1,
             {"role": "assistant", "content": "", "reasoning_content": "I should read the test first.",
              "tool_calls": [{"id": "call_read_01", "type": "function", "function": {
                  "name": "read", "arguments": json.dumps({"filePath": "/home/dev/project/tests/test_main.py"})}}]},
             {"role": "tool", "tool_call_id": "call_read_01", "content": (
                 "<file>\n00001| from src.main import add\n00002| \n00003| def test_add():\n"
                 "00004|     assert add(2, 2) == 5\n</file>")}]
    turn3 = [*turn2,
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_bash_02", "type": "function", "function": {
                     "name": "bash", "arguments": json.dumps({"command": "python -m pytest -q tests/test_main.py",
                                                              "description": "Run the failing test"})}},
                 {"id": "call_read_03", "type": "function", "function": {
                     "name": "read", "arguments": json.dumps({"filePath": "/home/dev/project/src/main.py"})}},
                 {"id": "call_todo_04", "type": "function", "function": {"name": "todoread", "arguments": ""}}]},
             {"role": "tool", "tool_call_id": "call_bash_02", "content": "F\nAssertionError: assert 4 == 5\n1 failed"},
             {"role": "tool", "tool_call_id": "call_read_03",
              "content": [{"type": "text", "text": "<file>\n00001| def add(a, b):\n"},
                          {"type": "text", "text": "00002|     return a + b\n</file>"}]},
             {"role": "tool", "tool_call_id": "call_todo_04", "content": "[]"},
             {"role": "system", "content": "<system-reminder>Your todo list is empty. Keep it up to date."
                                           "</system-reminder>"},
             {"role": "user", "content": "The test is wrong, not the code. Fix the test."}]
    turn4 = [*turn3,
             {"role": "assistant", "content": "", "reasoning_content": "Edit the assertion.", "tool_calls": [
                 {"id": "call_edit_05", "type": "function", "function": {
                     "name": "edit", "arguments": json.dumps({
                         "filePath": "/home/dev/project/tests/test_main.py",
                         "oldString": "assert add(2, 2) == 5", "newString": "assert add(2, 2) == 4"})}}]},
             {"role": "tool", "tool_call_id": "call_edit_05", "content": ""},
             {"role": "assistant", "content": "I fixed the assertion in tests/test_main.py."},
             {"role": "system", "content": "<system-reminder>The user switched to build mode.</system-reminder>"},
             {"role": "user", "content": [{"type": "text", "text": "Thanks."},
                                          {"type": "text", "text": "Now run the whole suite."}]}]
    return [turn1, turn2, turn3, turn4]


OPENCODE_TITLE: Json = {
    "model": MODEL, "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
                 {"role": "user", "content": "Generate a title for this conversation:\n"},
                 {"role": "user", "content": "Why does python -m pytest fail?"}]}


def test_opencode_session_streams(server: LiveServer) -> None:
    for i, messages in enumerate(opencode_session()):
        s = chat_stream(server, opencode_body(messages), OPENCODE_HEADERS, what=f"OpenCode turn {i + 1}")
        assert s.finish_reason in ("stop", "length")
        assert s.usage is not None and s.usage["completion_tokens"] <= 12


def test_opencode_session_turns_grow_the_prompt(server: LiveServer) -> None:
    """Each turn's prompt holds the one before it: nothing (tool results, reminders) is dropped."""
    prompts = []
    for messages in opencode_session():
        s = chat_stream(server, opencode_body(messages, max_tokens=1), OPENCODE_HEADERS)
        assert s.usage is not None
        prompts.append(s.usage["prompt_tokens"])
    assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts), prompts


def test_opencode_longest_turn_non_stream_and_reasoning(server: LiveServer) -> None:
    messages = opencode_session()[-1]
    r = post(server, "/v1/chat/completions", opencode_body(messages, stream=False, stream_options=None),
             OPENCODE_HEADERS)
    assert_ok(r, "OpenCode non-stream")
    check_chat_completion(r.json())
    # providerOptions that OpenCode passes for reasoning models, and the extra fields it may add
    s = chat_stream(server, opencode_body(messages, reasoning_effort="high", prompt_cache_key="ses_5c1d2e3f",
                                          top_p=1, parallel_tool_calls=True, user="ses_5c1d2e3f"),
                    OPENCODE_HEADERS, what="OpenCode reasoning turn")
    assert s.finish_reason in ("stop", "length")


def test_opencode_two_system_then_two_user(server: LiveServer) -> None:
    """[system, system, user, user] (field notes), streamed, and the title-generation side request."""
    messages = [*OPENCODE_SYSTEM, {"role": "user", "content": "hello"},
                {"role": "user", "content": "Summarize the README."}]
    s = chat_stream(server, opencode_body(messages), OPENCODE_HEADERS, what="[system, system, user, user]")
    assert s.finish_reason in ("stop", "length")
    chat_stream(server, OPENCODE_TITLE, OPENCODE_HEADERS, what="OpenCode title request")


def test_opencode_forced_tool_call_deltas_are_ai_sdk_shaped(server: LiveServer) -> None:
    """toolChoice {type: 'tool'} in the AI SDK: the streamed call must pass the AI SDK's checks."""
    body = opencode_body(opencode_session()[2], max_tokens=64,
                         tool_choice={"type": "function", "function": {"name": "todoread"}})
    s = chat_stream(server, body, OPENCODE_HEADERS, what="forced todoread")
    assert s.finish_reason == "tool_calls" and [c["name"] for c in s.calls.values()] == ["todoread"]
    assert s.text == ""


# =====================================================================================================
# Claude Code: Anthropic Messages, streamed, with its headers, system blocks, thinking and tools
# =====================================================================================================

CLAUDE_HEADERS = {
    "x-api-key": "sk-ant-local",
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
    "anthropic-dangerous-direct-browser-access": "true",
    "x-app": "cli",
    "User-Agent": "claude-cli/2.1.177 (external, cli)",
    "x-stainless-lang": "js",
    "x-stainless-retry-count": "0",
    "x-stainless-timeout": "600",
}
CLAUDE_BEARER_HEADERS = {k: v for k, v in CLAUDE_HEADERS.items() if k != "x-api-key"} | {
    "Authorization": "Bearer local-token"}


def billing_block(cch: str) -> Json:
    """The first system block of Claude Code >= 2.1.36; `cch` changes on every request."""
    text = f"x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=cli; cch={cch};"
    return {"type": "text", "text": text}


CLAUDE_SYSTEM_TEXT = (
    "You are an interactive CLI tool that helps users with software engineering tasks. Use the instructions "
    "below and the tools available to you to assist the user.\n\n"
    "IMPORTANT: Assist with authorized security testing only. You must NEVER generate or guess URLs for the "
    "user unless you are confident that the URLs are for helping the user with programming.\n\n"
    "# Tone and style\nYou should be concise, direct, and to the point, while providing complete information "
    "and matching the level of detail you provide in your response with the level of complexity of the "
    "user's query or the work you have completed.\n\n"
    "# Task Management\nYou have access to the TodoWrite tools to help you manage and plan tasks. Use these "
    "tools VERY frequently to ensure that you are tracking your tasks and giving the user visibility into "
    "your progress.\n\n"
    "# Doing tasks\nThe user will primarily request you perform software engineering tasks. This includes "
    "solving bugs, adding new functionality, refactoring code, explaining code, and more.\n\n"
    "Here is useful information about the environment you are running in:\n<env>\nWorking directory: "
    "/home/dev/project\nIs directory a git repo: Yes\nPlatform: darwin\nOS Version: Darwin 25.1.0\n"
    "Today's date: 2025-11-03\n</env>\nYou are powered by the model named Sonnet 4.5.")


def claude_system(cch: str | None = None) -> list[Json]:
    blocks = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
               "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": CLAUDE_SYSTEM_TEXT, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    return [billing_block(cch), *blocks] if cch is not None else blocks


def cc_schema(properties: Json, required: list[str]) -> Json:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
            "$schema": DRAFT7}


CLAUDE_TOOLS: list[Json] = [
    {"name": "Task", "description": "Launch a new agent to handle complex, multi-step tasks autonomously.",
     "input_schema": cc_schema({
         "description": {"type": "string", "description": "A short (3-5 word) description of the task"},
         "prompt": {"type": "string", "description": "The task for the agent to perform"},
         "subagent_type": {"type": "string", "description": "The type of specialized agent to use"},
     }, ["description", "prompt", "subagent_type"])},
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell session.",
     "input_schema": cc_schema({
         "command": {"type": "string", "description": "The command to execute"},
         "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
         "description": {"type": "string", "description": "Clear, concise description of what this command does"},
         "run_in_background": {"type": "boolean"},
     }, ["command"])},
    {"name": "Grep", "description": "A powerful search tool built on ripgrep",
     "input_schema": cc_schema({
         "pattern": {"type": "string"},
         "path": {"type": "string"},
         "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
         "-i": {"type": "boolean", "description": "Case insensitive search"},
         "-n": {"type": "boolean"},
         "head_limit": {"type": "number"},
     }, ["pattern"])},
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": cc_schema({
         "file_path": {"type": "string", "description": "The absolute path to the file to read"},
         "offset": {"type": "number"}, "limit": {"type": "number"},
     }, ["file_path"])},
    {"name": "Edit", "description": "Performs exact string replacements in files.",
     "input_schema": cc_schema({
         "file_path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
         "replace_all": {"type": "boolean", "default": False},
     }, ["file_path", "old_string", "new_string"])},
    {"name": "TodoWrite", "description": "Use this tool to create and manage a structured task list.",
     "input_schema": cc_schema({
         "todos": {"type": "array", "items": {
             "type": "object", "additionalProperties": False, "required": ["content", "status", "activeForm"],
             "properties": {"content": {"type": "string", "minLength": 1},
                            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                            "activeForm": {"type": "string", "minLength": 1}}}},
     }, ["todos"]),
     "cache_control": {"type": "ephemeral"}},
]

CLAUDE_METADATA = {"user_id": "user_2f9c_account__session_6b1e7a52-7a0c-4f5e-9d1b-0c4b8e6f2a11"}


def claude_body(messages: list[Json], *, cch: str | None = "36ee5", **extra: Any) -> Json:
    return {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True, "system": claude_system(cch),
            "messages": messages, "tools": CLAUDE_TOOLS, "metadata": CLAUDE_METADATA,
            "thinking": {"type": "enabled", "budget_tokens": 4}, **extra}


def claude_session() -> list[list[Json]]:
    """The `messages` of three consecutive Claude Code requests."""
    turn1 = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use the following "
                                 "context:\n# claudeMd\nRun tests with `make test`.\n</system-reminder>"},
        {"type": "text", "text": "why is the add test failing?", "cache_control": {"type": "ephemeral"}}]}]
    turn2 = [*turn1,
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "Let me read the test file.", "signature": "RXVvQ2dZSUFSQUJ"},
                 {"type": "text", "text": "I'll look at the test."},
                 {"type": "tool_use", "id": "toolu_01A9q", "name": "Read",
                  "input": {"file_path": "/home/dev/project/tests/test_main.py"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_01A9q",
                  "content": "     1\tfrom src.main import add\n     2\t\n     3\tdef test_add():\n"
                             "     4\t    assert add(2, 2) == 5\n"}]}]
    turn3 = [*turn2,
             {"role": "assistant", "content": [
                 {"type": "thinking", "thinking": "Run it and grep for add.", "signature": "RXVvQ2dZSUFSQUJ2"},
                 {"type": "tool_use", "id": "toolu_01B7x", "name": "Bash",
                  "input": {"command": "make test", "description": "Run the test suite"}},
                 {"type": "tool_use", "id": "toolu_01C3z", "name": "Grep",
                  "input": {"pattern": "def add", "output_mode": "content", "-n": True}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_01B7x", "is_error": True,
                  "content": [{"type": "text", "text": "Exit code 2\nFAILED tests/test_main.py::test_add"}]},
                 {"type": "tool_result", "tool_use_id": "toolu_01C3z",
                  "content": [{"type": "text", "text": "src/main.py:1:def add(a, b):"}]},
                 {"type": "text", "text": "<system-reminder>The TodoWrite tool hasn't been used recently."
                                          "</system-reminder>", "cache_control": {"type": "ephemeral"}}]}]
    return [turn1, turn2, turn3]


def test_claude_code_session_streams(server: LiveServer) -> None:
    for i, messages in enumerate(claude_session()):
        s = messages_stream(server, claude_body(messages, cch=f"{i:05x}"), CLAUDE_HEADERS,
                            what=f"Claude Code turn {i + 1}")
        assert s.stop_reason in ("end_turn", "max_tokens")


def test_claude_code_count_tokens_and_non_stream(server: LiveServer) -> None:
    turns = claude_session()
    counts = []
    for messages in turns:
        body = {"model": MODEL, "system": claude_system("00000"), "messages": messages, "tools": CLAUDE_TOOLS,
                "thinking": {"type": "enabled", "budget_tokens": 4}}
        r = post(server, "/v1/messages/count_tokens?beta=true", body,
                 CLAUDE_HEADERS | {"anthropic-beta": "token-counting-2024-11-01"})
        assert_ok(r, "count_tokens")
        counts.append(r.json()["input_tokens"])
    assert counts == sorted(counts) and counts[0] > 0, counts
    r = post(server, "/v1/messages?beta=true", claude_body(turns[-1], stream=False), CLAUDE_BEARER_HEADERS)
    assert_ok(r, "Claude Code non-stream")
    check_message(r.json())


def test_claude_code_side_requests(server: LiveServer) -> None:
    """The quota probe (max_tokens 1), a topic check without tools, a WebSearch sub-request whose only
    tool is a server tool, and adaptive thinking."""
    quota = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}],
             "metadata": CLAUDE_METADATA}
    r = post(server, "/v1/messages?beta=true", quota, CLAUDE_HEADERS)
    assert_ok(r, "quota probe")
    assert check_message(r.json())["usage"]["output_tokens"] == 1
    topic = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
             "system": [{"type": "text", "text": "Analyze if this message indicates a new conversation topic. "
                                                 "Format your response as a JSON object with two fields."}],
             "messages": [{"role": "user", "content": "why is the add test failing?"}]}
    messages_stream(server, topic, CLAUDE_HEADERS, what="topic check")
    search = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True,
              "system": [{"type": "text", "text": "You are an assistant for performing a web search tool use"}],
              "messages": [{"role": "user", "content": "Perform a web search for the query: mlx continuous batching"}],
              "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 8}]}
    messages_stream(server, search, CLAUDE_HEADERS, what="WebSearch sub-request")
    adaptive = claude_body(claude_session()[1], thinking={"type": "adaptive"},
                           context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    messages_stream(server, adaptive, CLAUDE_BEARER_HEADERS, what="adaptive thinking")


def test_claude_code_system_role_inside_messages(server: LiveServer) -> None:
    """Claude Code 2.1.154+ sends mid-conversation system messages as `role: "system"` entries of
    `messages` (string and text-block content), next to the top-level `system` (field notes)."""
    turn2 = claude_session()[1]
    messages = [
        {"role": "system", "content": "MCP server instructions: the `db` server answers SQL queries."},
        *turn2,
        {"role": "system", "content": [{"type": "text", "text": "<system-reminder>Skill `pytest` is available."
                                                                "</system-reminder>"}]},
        {"role": "user", "content": "Go on."},
    ]
    body = claude_body(messages)
    count = {k: body[k] for k in ("model", "system", "messages", "tools")}
    r = post(server, "/v1/messages/count_tokens?beta=true", count, CLAUDE_HEADERS)
    assert_ok(r, "count_tokens with role: system in messages")
    s = messages_stream(server, body, CLAUDE_HEADERS, what="role: system in messages")
    assert s.stop_reason in ("end_turn", "max_tokens")


def test_claude_code_long_max_tokens_stream_is_accepted_and_cancelled(server: LiveServer) -> None:
    """Claude Code asks for max_tokens 32000, more than this 4,096-token context leaves: the default
    policy clamps it (the reply may run to the context's end; `--max-tokens-policy error` answers
    Anthropic's sentence instead, tests/test_robustness.py); the stream carries the prompt's size
    in message_start; the client going away ends the generation."""
    body = claude_body(claude_session()[0], max_tokens=32000, thinking={"type": "enabled", "budget_tokens": 31999})
    with local_http.stream("POST", server.url + "/v1/messages?beta=true", json=body, headers=CLAUDE_HEADERS,
                      timeout=TIMEOUT) as r:
        assert_ok(r, "max_tokens 32000")
        seen = []
        first_data = ""
        for name, data in sse_frames(r):
            seen.append(name)
            first_data = first_data or data
            assert json.loads(data)["type"] == name
            if name == "content_block_delta":
                break
    assert seen[0] == "message_start" and "content_block_start" in seen
    started = json.loads(first_data)["message"]["usage"]
    assert started["input_tokens"] + started["cache_read_input_tokens"] > 1000  # the real prompt, not 0
    deadline = time.monotonic() + 15
    while local_http.get(server.url + "/health", timeout=10).json()["running"] > 0:
        assert time.monotonic() < deadline, "the abandoned generation kept running"
        time.sleep(0.05)


def claude_prefix_reuse(server: LiveServer, rotating_cch: bool) -> tuple[Json, Json]:
    """Two consecutive Claude Code turns; the second carries the first's answer. Returns both usages."""
    tag = uuid.uuid4().hex[:8]  # a conversation nobody sent before
    first = [{"role": "user", "content": [{"type": "text", "text": f"Session {tag}: list the failing tests."}]}]
    s1 = messages_stream(server, claude_body(first, cch="3f1a0" if rotating_cch else None, max_tokens=6),
                         CLAUDE_HEADERS, what="prefix turn 1")
    answer = [{k: v for k, v in b.items() if k != "citations"} for b in s1.blocks]
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": [{"type": "text", "text": "And the passing ones?"}]}]
    s2 = messages_stream(server, claude_body(second, cch="b77c2" if rotating_cch else None, max_tokens=6),
                         CLAUDE_HEADERS, what="prefix turn 2")
    return s1.usage, s2.usage


def test_claude_code_turns_reuse_the_prefix(server: LiveServer) -> None:
    _, second = claude_prefix_reuse(server, rotating_cch=False)
    assert second["cache_read_input_tokens"] > 0, second


def test_claude_code_turns_reuse_the_prefix_despite_the_billing_header(server: LiveServer) -> None:
    """vllm-mlx #522 (0% prefix reuse with Claude Code): the `cch=` nonce in system[0] changes every
    request, so a server that keeps it in the prompt never reuses anything."""
    _, second = claude_prefix_reuse(server, rotating_cch=True)
    assert second["cache_read_input_tokens"] > 0, second


# =====================================================================================================
# Codex CLI: the Responses API, streamed, stateless (store: false), with reasoning items
# =====================================================================================================

CODEX_SESSION = str(uuid.UUID("0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"))
CODEX_HEADERS = {
    "Authorization": "Bearer local",
    "OpenAI-Beta": "responses=experimental",
    "originator": "codex_cli_rs",
    "session_id": CODEX_SESSION,
    "conversation_id": CODEX_SESSION,
    "User-Agent": "codex_cli_rs/0.146.0 (Mac OS 26.1.0; arm64) ghostty/1.2.0",
    "Accept": "text/event-stream",
}
CODEX_INSTRUCTIONS = (
    "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a user's computer.\n\n"
    "## General\n\n- The arguments to `shell` will be passed to execvp(). Most terminal commands should be "
    "prefixed with [\"bash\", \"-lc\"].\n- Always set the `workdir` param when using the shell function.\n\n"
    "## Editing constraints\n\n- Default to ASCII when editing or creating files.\n- Use apply_patch for "
    "single file edits.")

CODEX_TOOLS: list[Json] = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
     "strict": False, "parameters": {
         "type": "object", "additionalProperties": False, "required": ["command"],
         "properties": {
             "command": {"type": "array", "items": {"type": "string"}, "description": "The command to execute"},
             "workdir": {"type": "string", "description": "The working directory to execute the command in"},
             "timeout_ms": {"type": "number", "description": "The timeout for the command in milliseconds"},
             "with_escalated_permissions": {"type": "boolean"},
             "justification": {"type": "string"}}}},
    {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
     "parameters": {
         "type": "object", "additionalProperties": False, "required": ["plan"],
         "properties": {
             "explanation": {"type": "string"},
             "plan": {"type": "array", "description": "The list of steps", "items": {
                 "type": "object", "additionalProperties": False, "required": ["step", "status"],
                 "properties": {"step": {"type": "string"},
                                "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}}}}}}},
    {"type": "function", "name": "apply_patch", "description": "Use the `apply_patch` tool to edit files.",
     "strict": False, "parameters": {"type": "object", "additionalProperties": False, "required": ["input"],
                                     "properties": {"input": {"type": "string"}}}},
    {"type": "function", "name": "view_image", "description": "Attach a local image to the conversation context.",
     "strict": False, "parameters": {"type": "object", "additionalProperties": False, "required": ["path"],
                                     "properties": {"path": {"type": "string"}}}},
]


def codex_body(input_items: list[Json], **extra: Any) -> Json:
    return {"model": MODEL, "instructions": CODEX_INSTRUCTIONS, "input": input_items, "tools": CODEX_TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": CODEX_SESSION,
            "max_output_tokens": 12, "temperature": 0, **extra}


def text_item(role: str, text: str) -> Json:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def codex_session() -> list[list[Json]]:
    """The `input` of three consecutive Codex requests (stateless: each carries the whole history)."""
    turn1 = [
        text_item("developer", "<permissions instructions>Filesystem sandboxing: workspace-write. Approvals: "
                               "on-request.</permissions instructions>"),
        text_item("user", "# AGENTS.md instructions for /home/dev/project\n\n<INSTRUCTIONS>Run `make test` before "
                          "you finish.</INSTRUCTIONS>"),
        text_item("user", "<environment_context>\n  <cwd>/home/dev/project</cwd>\n  <shell>zsh</shell>\n"
                          "</environment_context>"),
        text_item("user", "Fix the failing add test."),
    ]
    turn2 = [
        *turn1,
        {"type": "reasoning", "id": "rs_0a1b", "summary": [{"type": "summary_text", "text": "**Inspecting tests**"}],
         "content": None, "encrypted_content": "gAAAAABpQ2VuY3J5cHRlZC1yZWFzb25pbmc="},
        {"type": "function_call", "id": "fc_0a1c", "name": "shell", "call_id": "call_shell_1",
         "arguments": json.dumps({"command": ["bash", "-lc", "make test"], "workdir": "/home/dev/project"})},
        {"type": "function_call_output", "call_id": "call_shell_1",
         "output": json.dumps({"output": "FAILED tests/test_main.py::test_add\n",
                               "metadata": {"exit_code": 2, "duration_seconds": 0.4}})},
    ]
    turn3 = [
        *turn2,
        {"type": "reasoning", "id": "rs_0a1d", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Read both files."}], "encrypted_content": None},
        {"type": "function_call", "id": "fc_0a1e", "name": "shell", "call_id": "call_shell_2",
         "arguments": json.dumps({"command": ["bash", "-lc", "cat tests/test_main.py"]})},
        {"type": "function_call", "id": "fc_0a1f", "name": "update_plan", "call_id": "call_plan_3",
         "arguments": json.dumps({"plan": [{"step": "Fix the assertion", "status": "in_progress"}]})},
        {"type": "function_call_output", "call_id": "call_shell_2",
         "output": [{"type": "input_text", "text": "def test_add():\n    assert add(2, 2) == 5\n"}]},
        {"type": "function_call_output", "call_id": "call_plan_3", "output": "Plan updated"},
        {"type": "message", "role": "assistant", "id": "msg_0a20",
         "content": [{"type": "output_text", "text": "The assertion expects 5; it should be 4.", "annotations": []}]},
        text_item("developer", "<permissions instructions>Approvals: never.</permissions instructions>"),
        text_item("user", "Go ahead and fix it."),
    ]
    return [turn1, turn2, turn3]


def test_codex_session_streams(server: LiveServer) -> None:
    for i, items in enumerate(codex_session()):
        final = responses_stream(server, codex_body(items), CODEX_HEADERS, what=f"Codex turn {i + 1}")
        assert final["store"] is False and final["parallel_tool_calls"] is False
        assert [t["name"] for t in final["tools"]] == [t["name"] for t in CODEX_TOOLS]


def test_codex_non_stream_probe_and_output_schema(server: LiveServer) -> None:
    turn = codex_session()[-1]
    r = post(server, "/v1/responses", codex_body(turn, stream=False, reasoning={"effort": "minimal"},
                                                 text={"verbosity": "low"}), CODEX_HEADERS)
    assert_ok(r, "Codex non-stream")
    check_response(r.json())
    # the empty-input probe some Codex versions send first
    r = post(server, "/v1/responses", {"model": MODEL, "input": "", "stream": False, "max_output_tokens": 1},
             CODEX_HEADERS)
    assert_ok(r, "Codex probe")
    check_response(r.json())
    # `codex exec --output-schema`: the answer must fit the schema
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    body = codex_body(turn, reasoning={"effort": "minimal"}, max_output_tokens=32,
                      text={"format": {"type": "json_schema", "name": "codex_output_schema", "schema": schema,
                                       "strict": True}})
    final = responses_stream(server, body, CODEX_HEADERS, what="Codex output schema")
    text = "".join(p["text"] for item in final["output"] if item["type"] == "message" for p in item["content"])
    if final["status"] == "completed":
        assert isinstance(json.loads(text)["ok"], bool), text
    else:
        assert text.lstrip().startswith("{"), text


def test_codex_default_tool_array(server: LiveServer) -> None:
    """Codex (0.88+) always sends non-function tools next to its function tools: a `namespace` group of
    function tools, the hosted `web_search`, the freeform `custom` apply_patch. llama.cpp's 400 for them
    ("'type' of tool must be 'function'", codex#10635) made Codex unusable; a server that cannot run
    a tool kind should leave it out, not refuse the turn."""
    tools = [
        *[t for t in CODEX_TOOLS if t["name"] != "apply_patch"],
        {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agent tools", "tools": [
            {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent", "strict": False,
             "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}]},
        {"type": "web_search", "external_web_access": False},
        {"type": "custom", "name": "apply_patch", "description": "Use the `apply_patch` tool to edit files.",
         "format": {"type": "grammar", "syntax": "lark",
                    "definition": "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\n"
                                  "end_patch: \"*** End Patch\" LF?\nhunk: /(.|\\n)+/\n%import common.LF"}},
    ]
    final = responses_stream(server, codex_body(codex_session()[0], tools=tools), CODEX_HEADERS,
                             what="Codex default tool array")
    assert "shell" in [t["name"] for t in final["tools"]]


def test_codex_history_with_custom_tool_call(server: LiveServer) -> None:
    """A freeform apply_patch call and its output in the history (`custom_tool_call`,
    `custom_tool_call_output`), as Codex replays them on the next turn."""
    items = [
        *codex_session()[1],
        {"type": "custom_tool_call", "id": "ctc_0b01", "status": "completed", "call_id": "call_patch_4",
         "name": "apply_patch", "input": "*** Begin Patch\n*** Update File: tests/test_main.py\n@@\n"
                                         "-    assert add(2, 2) == 5\n+    assert add(2, 2) == 4\n*** End Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "call_patch_4",
         "output": "Success. Updated the following files:\nM tests/test_main.py\n"},
        text_item("user", "Now run the tests."),
    ]
    responses_stream(server, codex_body(items), CODEX_HEADERS, what="Codex custom_tool_call history")


# =====================================================================================================
# Qwen Code and Cline: OpenAI chat with developer roles, late system messages and echoed SDK messages
# =====================================================================================================

QWEN_TOOLS: list[Json] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Reads and returns the content of a specified file.",
        "parameters": {"type": "object", "required": ["absolute_path"], "properties": {
            "absolute_path": {"type": "string", "description": "The absolute path to the file to read"},
            "offset": {"type": "number"}, "limit": {"type": "number"}}}}},
    {"type": "function", "function": {
        "name": "run_shell_command", "description": "Executes a given shell command.",
        "parameters": {"type": "object", "required": ["command"], "properties": {
            "command": {"type": "string"}, "description": {"type": "string"},
            "directory": {"type": "string"}, "is_background": {"type": "boolean"}}}}},
]


def test_qwen_code_session(server: LiveServer) -> None:
    """Qwen Code (the openai SDK): cache_control on text parts, metadata, an assistant message echoed
    with the SDK's null fields, a tool result right after it, streamed with usage."""
    messages: list[Json] = [
        {"role": "system", "content": [{"type": "text", "text": "You are Qwen Code, an interactive CLI agent.",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": "This is the Qwen Code. We are setting up the context for our chat.\n"
                                    "My operating system is: darwin"},
        {"role": "assistant", "content": "Got it. Thanks for the context!"},
        {"role": "user", "content": [{"type": "text", "text": "Read src/main.py",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
         "annotations": [], "tool_calls": [
             {"index": 0, "id": "call_9f1c", "type": "function", "function": {
                 "name": "read_file", "arguments": json.dumps({"absolute_path": "/home/dev/project/src/main.py"})}}]},
        {"role": "tool", "tool_call_id": "call_9f1c", "content": "def add(a, b):\n    return a + b\n"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": QWEN_TOOLS, "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 12, "temperature": 0, "top_p": 1,
            "metadata": {"sessionId": "6a0e5b8c", "promptId": "6a0e5b8c########1"}}
    headers = {"Authorization": "Bearer local", "User-Agent": "QwenCode/0.1.0 (darwin; arm64)",
               "X-DashScope-CacheControl": "enable"}
    chat_stream(server, body, headers, what="Qwen Code tool turn")
    # the next turn: a system message that is not first (a compressed-history note), then the user
    follow = [*messages, {"role": "assistant", "content": "add returns a + b."},
              {"role": "system", "content": "The chat history was compressed."},
              {"role": "user", "content": "Write a test for it."}]
    chat_stream(server, body | {"messages": follow}, headers, what="Qwen Code late system message")


def test_cline_session(server: LiveServer) -> None:
    """Cline-style: a developer message first, a system message that is not first, consecutive user
    messages, a tool message right after the assistant's tool calls; max_completion_tokens; both
    streamed (without stream_options: no usage chunk) and not."""
    messages: list[Json] = [
        {"role": "developer", "content": "You are Cline, a highly skilled software engineer."},
        {"role": "user", "content": [{"type": "text", "text": "<task>\nRename add to plus\n</task>"},
                                     {"type": "text", "text": "<environment_details>\n# Current Working Directory "
                                                              "(/home/dev/project) Files\nsrc/main.py\n"
                                                              "</environment_details>"}]},
        {"role": "system", "content": "Tool use is formatted using XML-style tags or native tool calls."},
        {"role": "user", "content": "Use native tool calls."},
        {"role": "assistant", "content": "I'll read the file first.", "tool_calls": [
            {"id": "call_c1", "type": "function", "function": {
                "name": "read_file", "arguments": json.dumps({"absolute_path": "src/main.py"})}}]},
        {"role": "tool", "tool_call_id": "call_c1", "content": "def add(a, b):\n    return a + b\n"},
        {"role": "developer", "content": "# TODO LIST UPDATE REQUIRED"},
        {"role": "user", "content": "[read_file for 'src/main.py'] Result: shown above."},
        {"role": "user", "content": "<environment_details>\n# Current Time\n2025-11-03 10:00\n</environment_details>"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": QWEN_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": False, "max_completion_tokens": 12, "temperature": 0}
    r = post(server, "/v1/chat/completions", body, {"Authorization": "Bearer local"})
    assert_ok(r, "Cline non-stream")
    msg = check_chat_completion(r.json())
    assert r.json()["usage"]["completion_tokens"] <= 12
    s = chat_stream(server, body | {"stream": True}, {"Authorization": "Bearer local"}, what="Cline stream")
    assert s.text == (msg.get("content") or "") and s.usage is None


# =====================================================================================================
# Across clients: at once, and an unknown model (Claude Code and Codex name their own)
# =====================================================================================================


def test_agents_at_once(server: LiveServer) -> None:
    """Agents overlap their requests (a side request next to the main turn, sub-agents): every stream
    still arrives whole, never a 200 followed by an error frame (vllm-mlx #540)."""
    jobs: dict[str, Callable[[], object]] = {
        "opencode": lambda: chat_stream(server, opencode_body(opencode_session()[2]), OPENCODE_HEADERS),
        "opencode-title": lambda: chat_stream(server, OPENCODE_TITLE, OPENCODE_HEADERS),
        "claude": lambda: messages_stream(server, claude_body(claude_session()[2]), CLAUDE_HEADERS),
        "claude-quota": lambda: messages_stream(server, {"model": MODEL, "max_tokens": 1, "stream": True,
                                                         "messages": [{"role": "user", "content": "quota"}]},
                                                CLAUDE_HEADERS),
        "codex": lambda: responses_stream(server, codex_body(codex_session()[2]), CODEX_HEADERS),
        "codex-2": lambda: responses_stream(server, codex_body(codex_session()[1]), CODEX_HEADERS),
    }
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            jobs[name]()
        except BaseException as exc:
            errors[name] = exc

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a request never finished"
    assert not errors, errors


# -- an unknown model (Claude Code and Codex name their own) is a 404, and harmless


@pytest.mark.parametrize("path,body,headers", [
    ("/v1/chat/completions", {"model": "qwen3-coder:30b", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]}, OPENCODE_HEADERS),
    ("/v1/messages?beta=true", {"model": "claude-sonnet-4-5-20250929", "max_tokens": 4,
                                "messages": [{"role": "user", "content": "hi"}]}, CLAUDE_HEADERS),
    ("/v1/responses", {"model": "gpt-5-codex", "input": "hi", "max_output_tokens": 4}, CODEX_HEADERS),
])
def test_unknown_model_is_a_404_and_the_served_model_stays(server: LiveServer, path: str, body: Json,
                                                           headers: dict[str, str]) -> None:
    r = post(server, path, body, headers)
    assert r.status_code == 404, r.text
    if path.startswith("/v1/messages"):
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    else:
        assert r.json()["error"]["message"]
    assert local_http.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    again = post(server, path, body | {"model": MODEL}, headers)
    assert_ok(again, "the served model after an unknown one")

"""End to end on the embedded default model, ``relay-tiny-agent`` (issue 19, point 3): a trained
model that thinks, calls declared tools on its own, answers tool results and writes JSON, driven
over real HTTP through the real parsers, greedy, nothing forced (``tool_choice`` auto or absent).

One live server of the default model (``default_config()`` without a model: what `mlx-relay
serve` and ``Relay.start()`` serve, under its own name) is shared by every test here. The prompts
are held-out examples of the model's curriculum (``tools/agent_curriculum.py``, split 1: never
trained on), written out by hand: the model knows those shapes only (a ``verb_object`` tool with
typed parameters, "Please <verb> the <object> with ...", a ``{"status": "ok", "value": ...}``
result; "Reply with a JSON object with the keys ..."). Inside the agent clients' own prompts
(7-32K tokens) it knows one task, the stock lookup of ``make agents`` (``tools/agent_scenes.py``);
prefilling those prompts would add minutes to this suite (``tests/test_agent_sequences.py`` replays
their shapes on a random-weight model, ``make agents`` runs the agents themselves). So the last
test here sends OpenCode's request shape (its headers, some of its tools, its message layout) and
the streamed Anthropic round trip Claude Code's, around a curriculum-shaped tool and question:
the model's unforced call comes back through the streams those clients parse.

The wire checks (every delta and event well formed, exactly one finish reason, ``[DONE]``, no
``<think>``/``</think>``/``<tool_call>``/``<function=`` markup in any text) are
``tests/test_agent_sequences.py``'s.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from mlx_relay.chat.output import ReasoningDelta, ReplyDone, ReplyEvent, ReplyStarted, ToolCallEnd, ToolCallStart
from mlx_relay.chat.reply import ChatReply
from mlx_relay.relay import Relay, default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer
from tests.test_agent_sequences import (
    CLAUDE_HEADERS,
    CLAUDE_METADATA,
    OPENCODE_HEADERS,
    OPENCODE_TOOLS,
    assert_ok,
    chat_stream,
    check_chat_completion,
    check_message,
    messages_stream,
    responses_stream,
    zod_object,
)

AGENT = "relay-tiny-agent"  # the embedded default's served name
TIMEOUT = 120
TOOL_TOKENS = 160  # a thinking block and a call take about 100 tokens of this 1026-token vocabulary
ANSWER_TOKENS = 64
THINK = {"reasoning_effort": "high"}  # the template's thinking is off unless asked for

Json = dict[str, Any]


@pytest.fixture(scope="module")
def agent() -> Iterator[LiveServer]:
    """The default model, as `mlx-relay serve` without a MODEL serves it (MTP always, to exercise
    the drafts' deltas through the parsers; no warm-up: the tests compile what they run)."""
    config = default_config(max_num_seqs=4, max_queue=16, mtp_policy="always", warmup=False)
    with LiveServer(config) as live:
        yield live


def post(server: LiveServer, path: str, body: Json, headers: dict[str, str] | None = None) -> Json:
    r = local_http.post(server.url + path, json=body, headers=headers or {}, timeout=TIMEOUT)
    assert_ok(r, path)
    return r.json()


# -- held-out curriculum prompts (split 1), as OpenAI tools and messages ---------------------------------


def function(name: str, description: str, parameters: Json) -> Json:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def obj(properties: Json) -> Json:
    return {"type": "object", "properties": properties, "required": list(properties)}


# The tools of held-out tool examples 1 and 5, declared together in every tool request here (one
# system prompt, prefilled once: the prefix cache serves it to the later requests)
TOOLS = [
    function("delete_recipe", "Delete a recipe.", obj({
        "level": {"type": "integer"}, "size": {"type": "string", "enum": ["low", "medium", "high"]}})),
    function("find_order", "Find a order.", obj({"date": {"type": "number"}, "level": {"type": "string"}})),
    function("set_note", "Set a note.", obj({
        "email": {"type": "integer"}, "label": {"type": "boolean"}, "days": {"type": "string"}})),
]
# (the user's request, the call it wants)
RECIPE = ('Please delete the recipe with level 241 and size "medium".',
          ("delete_recipe", {"level": 241, "size": "medium"}))
NOTE = ('Please set the note with email 406 and label false and days "Quito".',
        ("set_note", {"email": 406, "label": False, "days": "Quito"}))
SYSTEM = "You are a helpful assistant."


def schema_of(tools: list[Json], name: str) -> Json:
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert name in declared, f"a call to an undeclared tool {name!r} (declared: {sorted(declared)})"
    return declared[name]


def check_call(tools: list[Json], name: str, arguments: Json, expected: tuple[str, Json]) -> None:
    """A call to a declared tool whose arguments validate against its JSON schema, and the one asked for."""
    jsonschema.validate(arguments, schema_of(tools, name))
    assert (name, arguments) == expected


def tool_result(value: str) -> str:
    return json.dumps({"status": "ok", "value": value})


# =====================================================================================================
# The default
# =====================================================================================================


def test_the_default_model_is_relay_tiny_agent_with_tools_and_reasoning(agent: LiveServer) -> None:
    models = local_http.get(agent.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [AGENT]
    assert models[0]["capabilities"]["tools"] and models[0]["capabilities"]["reasoning"]


# =====================================================================================================
# OpenAI chat completions: call, tool result, answer
# =====================================================================================================


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_openai_tool_call_then_answer(agent: LiveServer, stream: bool) -> None:
    """An unforced call (`tool_choice` "auto", absent when streamed) with its thinking in
    `reasoning_content`, `finish_reason: tool_calls`; the assistant turn and the tool's result sent
    back; an answer that uses the result, `stop`."""
    ask, expected = NOTE if stream else RECIPE
    messages: list[Json] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
    body: Json = {"model": AGENT, "messages": messages, "tools": TOOLS, "max_tokens": TOOL_TOKENS,
                  "temperature": 0, **THINK}
    body |= {"stream": True, "stream_options": {"include_usage": True}} if stream else {"tool_choice": "auto"}

    def send(body: Json) -> tuple[str, str | None, str | None, list[Json]]:
        """(finish_reason, reasoning_content, content, tool_calls) of a reply, streamed or not."""
        if stream:
            s = chat_stream(agent, body, what="chat stream")
            calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                     for _, c in sorted(s.calls.items())]
            return s.finish_reason, s.reasoning, s.text, calls
        reply = post(agent, "/v1/chat/completions", body)
        msg = check_chat_completion(reply, AGENT)
        return reply["choices"][0]["finish_reason"], msg.get("reasoning_content"), msg["content"], \
            msg.get("tool_calls") or []

    finish, reasoning, content, calls = send(body)
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls, content)
    assert not content, f"nothing but the call after the thinking: {content!r}"
    assert reasoning and expected[0] in reasoning, f"the thinking is reasoning_content: {reasoning!r}"
    call = calls[0]
    assert call["type"] == "function" and call["id"]
    check_call(TOOLS, call["function"]["name"], json.loads(call["function"]["arguments"]), expected)

    value = "731904" if stream else "265117"
    follow = [*messages, {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": calls},
              {"role": "tool", "tool_call_id": call["id"], "content": tool_result(value)}]
    finish, reasoning, content, calls = send(body | {"messages": follow, "max_tokens": ANSWER_TOKENS})
    assert finish == "stop" and not calls, (finish, calls)
    assert reasoning and value in reasoning, reasoning
    assert content and value in content and expected[0] in content, f"the answer uses the result: {content!r}"


def test_in_process_api_returns_the_parsed_reply(agent: LiveServer) -> None:
    """`Relay.chat` answers what HTTP answers, through the same reply layer: the call parsed (its
    arguments a JSON object string), the thinking as `reasoning`, no markup in `content`, usage
    with cached tokens; `Relay.stream_chat` yields the same reply as typed events."""
    ask, expected = RECIPE
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}]
    params: Json = {"tools": TOOLS, "max_tokens": TOOL_TOKENS, "temperature": 0, "enable_thinking": True}

    async def both(relay: Relay) -> tuple[ChatReply, list[ReplyEvent]]:
        reply = await relay.chat(messages, **params)
        events = [ev async for ev in relay.stream_chat(messages, **params)]
        return reply, events

    reply, events = agent.call(both)
    assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1, reply
    call = reply.tool_calls[0]
    assert call.id and isinstance(call.arguments, str)
    check_call(TOOLS, call.name, json.loads(call.arguments), expected)
    assert call.parsed_arguments() == expected[1]
    assert reply.reasoning and expected[0] in reply.reasoning and not reply.content.strip()
    for marker in ("<think>", "</think>", "<tool_call>", "<function="):
        assert marker not in reply.content and marker not in reply.reasoning
    assert "<tool_call>" in reply.raw_text and len(reply.token_ids) == reply.usage.completion_tokens
    assert reply.usage.prompt_tokens > 0 and reply.usage.reasoning_tokens > 0
    # the second request restores the first one's prompt from the prefix cache
    assert isinstance(events[0], ReplyStarted) and events[0].cached_tokens > 0
    assert isinstance(events[-1], ReplyDone) and events[-1].finish_reason == "tool_calls"
    ends = [ev for ev in events if isinstance(ev, ToolCallEnd)]
    assert [(e.name, json.loads(e.arguments)) for e in ends] == [(call.name, call.parsed_arguments())]
    assert "".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)) == reply.reasoning
    assert isinstance(next(ev for ev in events if isinstance(ev, ToolCallStart | ToolCallEnd)), ToolCallStart)


def test_openai_thinking_off_is_the_template_default(agent: LiveServer) -> None:
    """Without reasoning asked for, the prompt carries an empty thinking block: no reasoning_content,
    the call alone."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": RECIPE[0]}]
    body = {"model": AGENT, "messages": messages, "tools": TOOLS, "max_tokens": TOOL_TOKENS, "temperature": 0}
    reply = post(agent, "/v1/chat/completions", body)
    msg = check_chat_completion(reply, AGENT)
    assert reply["choices"][0]["finish_reason"] == "tool_calls" and not msg.get("reasoning_content"), msg
    [call] = msg["tool_calls"]
    check_call(TOOLS, call["function"]["name"], json.loads(call["function"]["arguments"]), RECIPE[1])


# =====================================================================================================
# Anthropic messages: tool_use, tool_result, answer, with thinking blocks
# =====================================================================================================


def anthropic_tools(tools: list[Json]) -> list[Json]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_anthropic_tool_use_then_answer(agent: LiveServer, stream: bool) -> None:
    """thinking + tool_use, `stop_reason: tool_use`; the assistant's blocks (the thinking with its
    signature) and a tool_result sent back; thinking + text that uses the result, `end_turn`.
    Streamed, the request is Claude Code's shape: its headers and `?beta=true`, system and user
    text blocks with cache_control, metadata, no tool_choice."""
    ask, expected = RECIPE if stream else NOTE
    body: Json = {"model": AGENT, "system": SYSTEM, "tools": anthropic_tools(TOOLS), "max_tokens": TOOL_TOKENS,
                  "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": 96}}
    if stream:
        headers, path = CLAUDE_HEADERS, "/v1/messages?beta=true"
        body |= {"system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                 "metadata": CLAUDE_METADATA, "stream": True}
        messages: list[Json] = [{"role": "user", "content": [{"type": "text", "text": ask,
                                                              "cache_control": {"type": "ephemeral"}}]}]
    else:
        headers, path = {"x-api-key": "local", "anthropic-version": "2023-06-01"}, "/v1/messages"
        body["tool_choice"] = {"type": "auto"}
        messages = [{"role": "user", "content": ask}]

    def send(body: Json) -> tuple[list[Json], str]:
        if stream:
            s = messages_stream(agent, body, headers, path=path)
            return s.blocks, s.stop_reason
        reply = check_message(post(agent, path, body, headers), AGENT)
        return reply["content"], reply["stop_reason"]

    blocks, stop = send(body | {"messages": messages})
    assert stop == "tool_use" and [b["type"] for b in blocks] == ["thinking", "tool_use"], blocks
    assert expected[0] in blocks[0]["thinking"] and blocks[0]["signature"], blocks[0]
    use = blocks[1]
    assert use["id"]
    check_call(TOOLS, use["name"], use["input"], expected)

    value = "408213" if stream else "55730"
    follow = [*messages, {"role": "assistant", "content": copy.deepcopy(blocks)},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                            "content": tool_result(value)}]}]
    blocks, stop = send(body | {"messages": follow, "max_tokens": ANSWER_TOKENS})
    assert stop == "end_turn" and [b["type"] for b in blocks] == ["thinking", "text"], blocks
    assert value in blocks[0]["thinking"]
    assert value in blocks[1]["text"] and expected[0] in blocks[1]["text"], f"the answer uses the result: {blocks[1]}"


# =====================================================================================================
# JSON: with response_format and in words only
# =====================================================================================================

# json example 0 (the keys in the system prompt) and 1 (all in the user's message), split 1
JSON_ASKS = {
    "json_object": ([{"role": "system",
                      "content": "Reply with a JSON object with the keys priority, query, mode, count."},
                     {"role": "user",
                      "content": 'The facts: priority is 956, query is 250, mode is 787, count is "Lena".'}],
                    {"priority": 956, "query": 250, "mode": 787, "count": "Lena"}),
    "words": ([{"role": "user",
                "content": 'Reply with a JSON object with the keys limit, target, count, unit. The facts: '
                           'limit is 925, target is "Cairo", count is "Chen", unit is "Riga".'}],
              {"limit": 925, "target": "Cairo", "count": "Chen", "unit": "Riga"}),
}


@pytest.mark.parametrize("how", list(JSON_ASKS))
def test_json_object_reply(agent: LiveServer, how: str) -> None:
    """`response_format: json_object` (a grammar from the end of the thinking on), or asked in words
    only: the content parses as an object with the requested keys (and the facts' values)."""
    messages, expected = JSON_ASKS[how]
    body: Json = {"model": AGENT, "messages": messages, "max_tokens": 128, "temperature": 0, **THINK}
    if how == "json_object":
        body["response_format"] = {"type": "json_object"}
    reply = post(agent, "/v1/chat/completions", body)
    msg = check_chat_completion(reply, AGENT)
    assert reply["choices"][0]["finish_reason"] == "stop" and msg.get("reasoning_content"), reply
    value = json.loads(msg["content"])
    assert isinstance(value, dict) and sorted(value) == sorted(expected), value
    assert value == expected


# =====================================================================================================
# Agent clients' request shapes around a curriculum-shaped tool and question
# =====================================================================================================


def test_opencode_shaped_unforced_call_streams_ai_sdk_deltas(agent: LiveServer) -> None:
    """OpenCode's request (its headers; two of its own tools as it declares them, zod-to-json-schema
    with `$schema` and `additionalProperties`, one without parameters; a curriculum tool in the same
    form; text parts; `tool_choice: auto`; streamed with usage): the model's own call comes back as
    the tool-call deltas the AI SDK validates (index, id, type and name on the first, argument
    fragments, one `finish_reason: tool_calls`, the usage chunk, [DONE]); then the tool's result,
    echoed as the AI SDK sends it, and a text answer that uses it."""
    tools = [t for t in OPENCODE_TOOLS if t["function"]["name"] in ("read", "todoread")]
    tools.append(function("book_route", "Book a route.", zod_object({"priority": {"type": "boolean"}}, ["priority"])))
    messages: list[Json] = [  # held-out tool example 4
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "Please book the route with priority false."}]}]
    body = {"model": AGENT, "max_tokens": TOOL_TOKENS, "temperature": 0, "messages": messages, "tools": tools,
            "tool_choice": "auto", "stream": True, "stream_options": {"include_usage": True}}
    s = chat_stream(agent, body, OPENCODE_HEADERS, what="OpenCode-shaped tool request")
    assert s.finish_reason == "tool_calls" and s.text == "" and len(s.calls) == 1, (s.finish_reason, s.text, s.calls)
    call = s.calls[0]
    check_call(tools, call["name"], json.loads(call["arguments"]), ("book_route", {"priority": False}))
    follow = [*messages, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
              {"role": "tool", "tool_call_id": call["id"], "content": tool_result("853770")}]
    s = chat_stream(agent, body | {"messages": follow, "max_tokens": ANSWER_TOKENS}, OPENCODE_HEADERS,
                    what="OpenCode-shaped tool result")
    assert s.finish_reason == "stop" and not s.calls and "853770" in s.text, (s.finish_reason, s.text)


def test_responses_function_call_then_answer(agent: LiveServer) -> None:
    """The Responses API as Codex uses it (streamed, `store: false`, the history replayed as items):
    a reasoning item and an unforced function_call item; then the call's output -> a message that
    uses it. (Without Codex's `"strict": false` on each tool, which the template would write into
    the tools block: the same prompt as the other tool tests', so the prefix cache serves it.)"""
    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    ask, expected = NOTE
    items: list[Json] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask}]}]
    body = {"model": AGENT, "instructions": SYSTEM, "input": items, "tools": tools, "tool_choice": "auto",
            "reasoning": {"effort": "high"}, "store": False, "stream": True, "max_output_tokens": TOOL_TOKENS,
            "temperature": 0}
    final = responses_stream(agent, body, {"Authorization": "Bearer local"}, what="Responses tool request")
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    assert expected[0] in final["output"][0]["content"][0]["text"]
    call = final["output"][1]
    check_call(TOOLS, call["name"], json.loads(call["arguments"]), expected)
    follow = [*items, *final["output"], {"type": "function_call_output", "call_id": call["call_id"],
                                         "output": tool_result("640417")}]
    final = responses_stream(agent, body | {"input": follow, "max_output_tokens": ANSWER_TOKENS},
                             {"Authorization": "Bearer local"}, what="Responses tool result")
    assert final["status"] == "completed" and [i["type"] for i in final["output"]] == ["reasoning", "message"]
    text = final["output"][1]["content"][0]["text"]
    assert "640417" in text and expected[0] in text, text

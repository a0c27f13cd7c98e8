"""Chat completions beyond plain text, on the real float32 tiny model over HTTP: structured output
and required tool calls enforced by llguidance grammars, tool-call streams, reasoning and its
budget, logprobs, n choices, penalties.

A random-weight model never calls a tool or writes JSON by itself; the grammars make it, so these
are end-to-end tests of the grammar, the parser and the wire format together (the trained
embedded model, which does both unforced, is `tests/test_relay_tiny_agent.py`'s).
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "count": {"type": "integer"}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12},
                                                        "limit": {"type": "integer"}},
                       "required": ["path", "limit"]}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a directory",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}},
                       "required": ["path"]}}},
]
USER = [{"role": "user", "content": "Read the file src/main.py please"}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_json_schema_output_is_valid(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)


def test_json_object_output_is_an_object(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model="tiny", messages=USER, max_tokens=64, temperature=0.8, seed=3,
                                          response_format={"type": "json_object"})
    choice = done.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert choice.message.content.lstrip().startswith("{")


def test_unenforceable_schema_is_a_400(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "^(?=a)b"}}}}}}
    r = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format"


def test_required_tool_call_is_well_formed(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                          max_tokens=300, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert "<tool_call>" not in (choice.message.content or "")


def test_named_tool_choice_streams_spec_shaped_deltas(server: LiveServer) -> None:
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 300, "temperature": 0, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "list_dir"}}}
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    with local_http.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                delta = c["delta"]
                assert "<tool_call>" not in (delta.get("content") or "") and "<function=" not in (
                    delta.get("content") or "")
                for tc in delta.get("tool_calls") or []:
                    if tc["index"] not in calls:  # the first chunk of a call names it
                        assert tc["id"].startswith("call_") and tc["type"] == "function"
                        assert tc["function"]["name"] and tc["function"]["arguments"] == ""
                        calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                    else:
                        assert set(tc) <= {"index", "function"}
                        calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
                if c["finish_reason"]:
                    finishes.append(c["finish_reason"])
    assert finishes == ["tool_calls"]
    assert list(calls) == [0] and calls[0]["name"] == "list_dir"
    assert isinstance(json.loads(calls[0]["arguments"])["path"], str)


def test_tool_round_trip_with_the_sdk(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=300, temperature=0)
    msg = first.choices[0].message
    assert len(msg.tool_calls) == 1
    history = [*USER, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "print('hello')"}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")


def test_reasoning_goes_to_reasoning_content_and_the_budget_closes_it(client: openai.OpenAI) -> None:
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    unbounded = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0,
                                               extra_body=think)
    msg = unbounded.choices[0].message
    assert msg.model_extra.get("reasoning_content") and not msg.content  # never closed by a random model
    assert unbounded.usage.completion_tokens_details.reasoning_tokens == 12
    bounded = client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0,
                                             extra_body={**think, "thinking_budget": 4})
    msg = bounded.choices[0].message
    assert msg.model_extra.get("reasoning_content")
    assert msg.content, "the budget closed the thinking block, the answer follows"
    assert "</think>" not in msg.content and "<think>" not in msg.model_extra["reasoning_content"]
    assert 4 <= bounded.usage.completion_tokens_details.reasoning_tokens < 24


def test_json_after_bounded_thinking(client: openai.OpenAI) -> None:
    done = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_budget": 3})
    msg = done.choices[0].message
    assert msg.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(msg.content), SCHEMA)


def test_logprobs_are_consistent_and_greedy_text_unchanged(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "def main():"}], "max_tokens": 10,
          "temperature": 0}
    plain = client.chat.completions.create(**kw)
    withlp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    assert withlp.choices[0].message.content == plain.choices[0].message.content
    content = withlp.choices[0].logprobs.content
    assert len(content) == withlp.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0.0 and len(tok.top_logprobs) == 3
        assert [t.logprob for t in tok.top_logprobs] == sorted((t.logprob for t in tok.top_logprobs), reverse=True)
        assert tok.top_logprobs[0].token == tok.token  # greedy: the chosen token is the most likely
        assert abs(tok.top_logprobs[0].logprob - tok.logprob) < 1e-4


def test_n_choices_with_a_seed(client: openai.OpenAI, server: LiveServer) -> None:
    kw = {"model": "tiny", "messages": USER, "max_tokens": 8, "temperature": 1.0, "seed": 11}
    done = client.chat.completions.create(**kw, n=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    again = client.chat.completions.create(**kw, n=3)
    assert [c.message.content for c in done.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in done.choices}) > 1
    assert done.usage.completion_tokens == sum(1 for _ in range(3)) * 8
    stream = client.chat.completions.create(**kw, n=2, stream=True, stream_options={"include_usage": True})
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert sorted(finishes) == [0, 1] and usage is not None and usage.completion_tokens == 16


def test_presence_penalty_stops_repeats(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "aaaa aaaa aaaa"}], "max_tokens": 24,
          "temperature": 0, "logprobs": True}
    done = client.chat.completions.create(**kw, presence_penalty=2.0, extra_body={"repetition_penalty": 50.0})
    # token strings (partial UTF-8 tokens all decode to U+FFFD, so those are left out)
    tokens = [t.token for t in done.choices[0].logprobs.content if "\ufffd" not in t.token]
    assert len(tokens) == len(set(tokens)), tokens


AUTO_TOOLS = [
    {"type": "function", "function": {
        "name": "set_unit", "description": "Set the unit",
        "parameters": {"type": "object", "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "label": {"type": "string", "maxLength": 6},
            "loud": {"type": "boolean"}}, "required": ["unit", "label"]}}},
    *TOOLS,
]
MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


def test_auto_tool_calls_the_model_opens_are_declared_and_valid(server: LiveServer) -> None:
    """`tool_choice` auto on the random-weight model, sampled hot (temperature 30: nearly uniform
    over the vocabulary, so `<tool_call>` comes up now and then, and after it anything would):
    every call it opens is a declared tool with arguments valid for its schema (a string enum
    raw, a bounded string, a boolean), and no tool markup reaches the text."""
    calls = []
    for seed in range(8):
        body = {"model": "tiny", "messages": USER, "tools": AUTO_TOOLS, "max_tokens": 300, "temperature": 30,
                "seed": seed}
        r = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert not any(tag in (message.get("content") or "") for tag in MARKUP), message["content"]
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            schema = next(t["function"]["parameters"] for t in AUTO_TOOLS if t["function"]["name"] == name)
            jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            calls.append(call)
    assert calls  # the seeds open calls (two of eight, measured): the grammar was exercised


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "list_dir"}}],
                         ids=["required", "named"])
def test_a_forced_call_after_thinking_comes_at_once(server: LiveServer, choice: object) -> None:
    """With thinking on, a forced call follows the thinking block at once (one or two newlines at
    most, which the parser drops): the reply is the call, with no whitespace content ahead of it.
    A wider separator let this random-weight model answer "\\r\\t" and no call."""
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 300, "temperature": 0,
            "tool_choice": choice, "chat_template_kwargs": {"enable_thinking": True}}
    r = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice_out = r.json()["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls", choice_out
    assert not choice_out["message"].get("content"), choice_out["message"]
    assert choice_out["message"]["reasoning_content"]
    assert len(choice_out["message"]["tool_calls"]) >= 1


def loose_tools_total(server: LiveServer) -> float:
    text = local_http.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mlx_relay:tool_grammar_loose_tools_total"))


def test_a_schema_the_grammar_cannot_hold_loosens_auto_and_refuses_forced(server: LiveServer) -> None:
    """A tool whose schema constrains the argument object as a whole (`minProperties`): with `auto`
    the request runs (that tool's calls only well-formed, counted in /metrics); forced, a 400 that
    names the tool."""
    odd = {"type": "function", "function": {"name": "odd_tool", "parameters": {
        "type": "object", "minProperties": 1, "properties": {"a": {"type": "string"}}}}}
    before = loose_tools_total(server)
    body = {"model": "tiny", "messages": USER, "tools": [*TOOLS, odd], "max_tokens": 4, "temperature": 0}
    r = local_http.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert loose_tools_total(server) == before + 1
    forced = {**body, "tool_choice": {"type": "function", "function": {"name": "odd_tool"}}}
    r = local_http.post(server.url + "/v1/chat/completions", json=forced, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tool_choice" and "odd_tool" in r.json()["error"]["message"]

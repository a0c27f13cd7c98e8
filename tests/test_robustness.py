"""No request can take the server down (issue 15): one regression test per class of input that
crashed, stalled or 500'd the server, on a live server with the fp32 fixture.

Each test also checks the server is still whole afterwards (`/health` ready, nothing down, a
normal request answered), since the failures it guards against were silent ones: an actor
stopped for good while `/health` said ready.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

TIMEOUT = 60.0
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def guarded(fp32_model: Path) -> Iterator[LiveServer]:
    """A server with tight limits: 1 s to send a request, 2 s for a client to take a write,
    256 KiB bodies, clients' own chat templates (1 s each), max_tokens beyond the context refused."""
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=4, warmup=False,
                            read_timeout_s=1.0, stall_timeout_s=2.0, max_request_bytes=256 * 1024,
                            allow_request_chat_template=True, template_timeout_s=1.0, max_tokens_policy="error")
    with LiveServer(config) as live:
        yield live


def post(server: LiveServer, path: str, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return local_http.post(server.url + path, content=content, timeout=TIMEOUT,
                      headers={"content-type": "application/json", **headers})


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    if param is not None:
        assert err["param"] == param, err
    return err


def anthropic_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and {"type", "message"} <= set(body["error"]), body
    return body["error"]


def still_whole(server: LiveServer) -> None:
    health = local_http.get(server.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and "down" not in health.json(), health.text
    r = post(server, CHAT, {"messages": USER, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_native_panic_in_the_grammar_library_is_a_400(server: LiveServer) -> None:
    """A json_schema whose `minimum` is a non-ASCII string made llguidance panic (a BaseException
    that passed the actors' `except Exception` and stopped the whole actor system)."""
    schema = {"type": "object", "properties": {"a": {"type": "number", "minimum": "é" * 60}}}
    for _ in range(3):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = post(server, CHAT, {"messages": USER, "max_tokens": 4, "response_format": fmt})
        err = openai_error(r, 400, "response_format")
        assert "minimum" in err["message"]
    still_whole(server)


@pytest.mark.parametrize("key", ["tokenize", "add_generation_prompt", "conversation", "tools",
                                 "continue_final_message", "documents", "messages", "return_dict"])
def test_template_kwargs_that_collide_with_the_template_call_are_a_400(server: LiveServer, key: str) -> None:
    r = post(server, CHAT, {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {key: True}})
    openai_error(r, 400, "chat_template_kwargs")


def test_bad_tool_schemas_are_a_400_and_never_stop_the_normalizer(server: LiveServer) -> None:
    bad = [{"type": "object", "properties": ["a", "b"]},
           {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
           {"type": "object", "properties": {"a": {"type": "string", "minLength": 2.5}}},
           {"type": "object", "properties": {"a": {"type": "string", "minLength": "3"}}}]
    for _ in range(2):  # more than the five crashes a minute that used to switch the Normalizer off
        for params in bad:
            tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
            for choice in ("auto", "required"):
                r = post(server, CHAT, {"messages": USER, "max_tokens": 2, "tools": tools, "tool_choice": choice})
                openai_error(r, 400, "tools")
    still_whole(server)


def nested(depth: int) -> bytes:
    """A JSON Schema nested `depth` objects deep (as text: encoders refuse to nest this deep)."""
    return b'{"type": "object", "properties": {"x": ' * depth + b'{"type": "string"}' + b"}}" * depth


def test_deep_nesting_is_a_400(server: LiveServer) -> None:
    user = msgspec.json.encode(USER)
    tools = b'[{"type": "function", "function": {"name": "f", "parameters": ' + nested(900) + b"}}]"
    openai_error(post(server, CHAT, b'{"messages": ' + user + b', "tools": ' + tools + b"}"), 400)
    fmt = b'{"type": "json_schema", "json_schema": {"name": "x", "schema": ' + nested(900) + b"}}"
    openai_error(post(server, CHAT, b'{"messages": ' + user + b', "response_format": ' + fmt + b"}"), 400)
    deep = b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    openai_error(post(server, CHAT, deep), 400)
    anthropic_error(post(server, "/v1/messages", deep), 400)
    still_whole(server)


def test_invalid_utf8_is_a_400_on_every_route(server: LiveServer) -> None:
    raw = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    openai_error(post(server, CHAT, raw), 400)
    anthropic_error(post(server, "/v1/messages", raw), 400)
    anthropic_error(post(server, "/v1/messages/count_tokens", raw), 400)
    openai_error(post(server, "/v1/responses", b'{"model": "tiny", "input": "\xff"}'), 400)


@pytest.mark.parametrize(("field", "value", "status"), [
    ("seed", -1, 400), ("seed", 2**64, 400), ("seed", 2**63, 400),
    ("presence_penalty", 1e308, 400), ("frequency_penalty", -1e308, 400),
    ("repetition_penalty", 0, 400), ("repetition_penalty", -1.0, 400),
    ("max_tokens", 0, 400), ("temperature", -1, 400), ("top_p", 0, 400),
])
def test_numbers_out_of_range_are_a_4xx(server: LiveServer, field: str, value: object, status: int) -> None:
    r = post(server, CHAT, {"messages": USER, "max_tokens": 2, field: value})
    err = openai_error(r, status)
    assert err["param"] is None or field in err["param"], err


def test_max_tokens_beyond_the_context_is_clamped_or_a_400(server: LiveServer, guarded: LiveServer) -> None:
    """Clamped by default (the reply may run to the context's end); refused under
    `--max-tokens-policy error`: OpenAI's shape, and on /v1/messages Anthropic's own sentence with
    the numbers Claude Code parses to lower max_tokens and retry."""
    r = post(server, CHAT, {"messages": USER, "max_tokens": 100_000, "temperature": 0, "stop": ["\n"]})
    assert r.status_code == 200, r.text
    err = openai_error(post(guarded, CHAT, {"messages": USER, "max_tokens": 100_000}), 400, "max_tokens")
    assert "4096" in err["message"] and err["code"] == "context_length_exceeded"
    body = {"model": "tiny", "max_tokens": 100_000, "messages": USER}
    for stream in (False, True):
        err = anthropic_error(post(guarded, "/v1/messages", body | {"stream": stream}), 400)
        assert err["type"] == "invalid_request_error"
        match = CLAUDE_CODE_OVERFLOW.fullmatch(err["message"])
        assert match is not None, err["message"]
        prompt, max_tokens, context = map(int, match.groups())
        assert (max_tokens, context) == (100_000, 4096) and 0 < prompt < 100 and prompt + max_tokens > context


# Claude Code's reading of Anthropic's max_tokens overflow (it retries with max_tokens = C - P - margin)
CLAUDE_CODE_OVERFLOW = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), "
                                  r"decrease input length or `max_tokens` and try again")


def test_tool_call_arguments_nested_past_the_decoder_are_a_400_in_each_routes_shape(server: LiveServer) -> None:
    """An assistant turn's tool-call arguments are a JSON string the body's depth check never
    sees; nested 10,000 levels they are a 400 naming the messages, not a 500."""
    deep = '{"a":' * 10_000 + "1" + "}" * 10_000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    err = openai_error(post(server, CHAT, {"messages": messages, "max_tokens": 2}), 400, "messages")
    assert "nested too deeply" in err["message"]
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    for stream in (False, True):
        r = post(server, "/v1/responses", {"model": "tiny", "input": items, "max_output_tokens": 2, "stream": stream})
        assert "nested too deeply" in openai_error(r, 400, "messages")["message"]
    still_whole(server)


def test_a_grammar_that_fails_while_generating_is_refused_before_admission(server: LiveServer) -> None:
    """Thousands of optional properties pass llguidance's validation and blow its parser's row
    limit at the first token: that used to be a 500 in the middle of the answer."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    r = post(server, CHAT, {"messages": USER, "max_tokens": 8, "stream": True,
                            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert "fails when generating" in openai_error(r, 400, "response_format")["message"]


def test_anthropic_routes_answer_404_and_405_in_their_own_shape(server: LiveServer) -> None:
    r = local_http.get(server.url + "/v1/messages", timeout=TIMEOUT)
    assert anthropic_error(r, 405)["type"] == "invalid_request_error"
    r = post(server, "/v1/messages/nope", {})
    assert anthropic_error(r, 404)["type"] == "not_found_error"
    openai_error(local_http.get(server.url + "/v1/nope", timeout=TIMEOUT), 404)


def test_anthropic_message_start_carries_the_prompt_size(server: LiveServer) -> None:
    body = {"model": "tiny", "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "Hello there"}]}
    count = post(server, "/v1/messages/count_tokens", {"model": "tiny", "messages": body["messages"]}).json()
    with local_http.stream("POST", server.url + "/v1/messages", json=body, timeout=TIMEOUT) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    usage = json.loads(first[6:])["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == count["input_tokens"] > 0


def test_request_chat_templates_are_refused_unless_allowed(server: LiveServer) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    openai_error(post(server, CHAT, {"messages": USER, "chat_template_kwargs": {"chat_template": template}}), 400,
                 "chat_template")


def test_allowed_request_templates_render_sandboxed_with_a_time_limit(guarded: LiveServer) -> None:
    ok = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
         "<|im_start|>assistant\n"
    r = post(guarded, CHAT, {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"chat_template": ok}})
    assert r.status_code == 200, r.text
    slow = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
    # (stopped at the server's 1 s limit, its message says; the client's TIMEOUT is only a hang guard)
    err = openai_error(post(guarded, CHAT, {"messages": USER, "chat_template_kwargs": {"chat_template": slow}}), 400,
                       "chat_template")
    assert "within 1s" in err["message"]
    bomb = "{{ 'a' * 4000000000 }}"
    openai_error(post(guarded, CHAT, {"messages": USER, "chat_template_kwargs": {"chat_template": bomb}}), 400,
                 "chat_template")
    still_whole(guarded)


def test_oversized_bodies_are_a_413_in_the_routes_shape(guarded: LiveServer) -> None:
    big = {"messages": [{"role": "user", "content": "x" * 300_000}]}
    err = openai_error(post(guarded, CHAT, big), 413)
    assert err["code"] == "request_too_large"
    anthropic_error(post(guarded, "/v1/messages", {"model": "tiny", "max_tokens": 2, **big}), 413)


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server: LiveServer) -> None:
    """12 MB of text cannot fit a 4,096-token context: the character count proves it at once, before
    the tokenizer runs (its message gives the count's lower bound, "at least": the tokenizer's
    path names the exact count; tokenizing it would take ~15 s here)."""
    r = post(server, CHAT, {"messages": [{"role": "user", "content": "word " * 2_400_000}]})
    err = openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and "has at least" in err["message"], err
    r = post(server, "/v1/messages/count_tokens", {"model": "tiny",
                                                   "messages": [{"role": "user", "content": "word " * 2_400_000}]})
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", anthropic_error(r, 400)["message"])
    assert match is not None and int(match[1]) > int(match[2]) == 4 * 4096  # count_tokens counts up to 4x the context
    r = post(server, "/v1/messages", {"model": "tiny", "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "word " * 6000}]})
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", anthropic_error(r, 400)["message"])
    assert match is not None and int(match[1]) > int(match[2]) == 4095


def test_slow_and_half_sent_requests_are_timed_out(guarded: LiveServer) -> None:
    host, port = "127.0.0.1", guarded.config.port
    headers_only = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"  # headers never finish
    body_short = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{\"messages\": [")  # the body never finishes
    socks = []
    for raw in (headers_only, body_short):
        # (the server's limit is 1 s; the sockets' 30 s only guards against a hang)
        s = socket.create_connection((host, port), timeout=30)
        s.sendall(raw)
        socks.append(s)
    answers = []
    for s in socks:
        data = b""
        while chunk := s.recv(65536):  # the server closes the connection
            data += chunk
        answers.append(data)
        s.close()
    assert answers[0] == b""  # no request ever started
    assert answers[1].startswith(b"HTTP/1.1 408"), answers[1][:200]


def test_a_client_that_stops_reading_does_not_hold_its_slot(guarded: LiveServer,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A stream nobody reads fills the socket buffers; the write then stalls and, after the stall
    timeout, the response ends and its generation and slot are freed. The grammar keeps the
    reply from ending on its own (a 20,000-character string must come first)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 20000}}, "required": ["s"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = json.dumps({"messages": USER, "max_tokens": 4000, "stream": True, "logprobs": True, "top_logprobs": 20,
                       "n": 4, "response_format": fmt})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", guarded.config.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              + f"content-length: {len(body)}\r\n\r\n".encode() + body.encode())
    try:  # never read
        deadline = time.monotonic() + 30
        while local_http.get(guarded.url + "/health", timeout=TIMEOUT).json()["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        while local_http.get(guarded.url + "/health", timeout=TIMEOUT).json()["running"] > 0:
            assert time.monotonic() < deadline, "the stalled client kept its slot"
            time.sleep(0.2)
    finally:
        s.close()
    assert "the client took no data for 2s" in caplog.text
    still_whole(guarded)


# -- forced tool choice always ends properly ------------------------------------------------------------

FREE_TOOLS = [  # string arguments without a length bound: a sampling model may write on and on
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
        "required": ["path", "text"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}},
]


def test_forced_tool_calls_end_after_the_calls_or_at_max_tokens_never_a_500(server: LiveServer) -> None:
    """`required` with parallel calls allowed (the default): at most one call per declared tool,
    then the reply ends; a call cut by max_tokens ends the reply "length" (no broken call)."""
    finishes = set()
    for seed in range(4):
        body = {"messages": USER, "tools": FREE_TOOLS, "tool_choice": "required", "max_tokens": 16 + 24 * seed,
                "temperature": 1.0, "seed": seed}
        r = post(server, CHAT, body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        finishes.add(choice["finish_reason"])
        calls = choice["message"].get("tool_calls") or []
        assert len(calls) <= len(FREE_TOOLS)
        if choice["finish_reason"] == "tool_calls":
            assert calls and all(json.loads(c["function"]["arguments"]) for c in calls)
        else:
            assert choice["finish_reason"] == "length", choice
    assert finishes <= {"tool_calls", "length"}


def test_forced_tool_calls_leave_the_thinking_room_for_the_call(server: LiveServer) -> None:
    """A thinking template and a model that would think until max_tokens: the budget stops the
    thinking at half the tokens, so the forced call still comes."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    body = {"messages": USER, "tools": tools, "tool_choice": "required", "max_tokens": 120, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": True}}
    r = post(server, CHAT, body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] <= 60 + 3
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "ping"


def test_anthropic_forced_tool_use_excludes_extended_thinking(server: LiveServer) -> None:
    tools = [{"name": "write_file", "input_schema": FREE_TOOLS[0]["function"]["parameters"]}]  # type: ignore[index]
    body = {"model": "tiny", "max_tokens": 60, "messages": USER, "tools": tools, "tool_choice": {"type": "any"}}
    r = post(server, "/v1/messages", {**body, "thinking": {"type": "enabled", "budget_tokens": 30}})
    assert "thinking" in anthropic_error(r, 400)["message"]
    r = post(server, "/v1/messages", {**body, "temperature": 1.0})
    assert r.status_code == 200, r.text
    message = r.json()
    assert message["stop_reason"] in ("tool_use", "max_tokens"), message
    assert not any(b["type"] == "thinking" for b in message["content"])

"""The requests real coding agents sent, replayed against a server in process (issue 30, point 3).

`make agents` (benchmarks/agents/run_agents.py) runs Claude Code, Codex, Qwen Code, OpenCode and
Cline, pinned, against `mlx-relay serve` through a recording proxy; with `--save-fixtures` it
writes every POST each agent made, whole, to `tests/agent_requests/<agent>/NNN.json`: method,
path, headers as sent (credentials replaced by `<redacted>`), body as sent. Re-record them when an
agent's pin moves. (`claude-code-toolsearch/` is Claude Code's tool search round trip, recorded
in the same format against a stub that scripted the model's turns: ToolSearch, then the MCP call.)
This file replays each one against a server under the name the agents asked
for (`relay-tiny-agent`, the embedded model's), with its tokenizer and context, so a change that
breaks the shape of what an agent sends (a field, a role, a tool type, a header) fails here, in
`make test`.

What the replay changes, and why (the 2-core suite cannot prefill the agents' 10-30K-token
prompts: relay-tiny-agent prefilled Claude Code's 26K tokens in about 6 minutes on this loaded CPU;
the fixture model below is 8x faster, and the cut prompts are 0.5-7K tokens):

- every string longer than `TEXT_LIMIT` characters is cut to that length (system prompts,
  message and tool-result text), tools' and schemas' descriptions to `DESCRIPTION_LIMIT`. Keys,
  roles, content-block types, tools and their schemas' structure, headers and every other field
  stay as sent; strings that must stay whole to mean anything (`arguments`, a schema's `pattern`,
  `encrypted_content`) are never cut;
- the reply is capped at `REPLY_TOKENS` tokens in the API's own field (`max_tokens`,
  `max_completion_tokens`, `max_output_tokens`), set when the agent sent none.

Every such request must answer 200 with the right content type and a well-formed stream ending
with its API's terminal event (the checks of `tests/test_agent_sequences.py`). And a prompt past
the context must get the refusal the agent's SDK understands, before anything runs: Qwen Code's
and Claude Code's first requests, their last user text padded past 32K tokens, answer 400 in the
route's error shape (OpenAI's `context_length_exceeded`; Anthropic's `invalid_request_error`);
that costs a tokenization, not a prefill. (Qwen Code's own prompt, 31.7K tokens at 0.24.4, fits
the embedded model's 32K context; recorded with its `max_tokens: 32000` it was refused for that.)
What the agents do with the answers (a tool round trip, a completed turn) is `make agents`'s to
check: it needs the agents themselves. What the server does with a recorded tool loop is checked
here (issue 43): each round restores the previous request's whole prompt from the prefix cache.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer
from tests.test_agent_sequences import (
    assert_ok,
    chat_stream,
    check_chat_completion,
    check_message,
    check_response,
    messages_stream,
    responses_stream,
)

FIXTURES = Path(__file__).parent / "agent_requests"
CASES = sorted(FIXTURES.glob("*/*.json"))
AGENT_MODEL = "relay-tiny-agent"  # the name the agents were configured with (the embedded model's)
TEXT_LIMIT = 120
DESCRIPTION_LIMIT = 16  # tools' and schemas' descriptions: most of what is left of a cut prompt
KEEP_WHOLE = frozenset({"arguments", "pattern", "encrypted_content", "model", "signature"})
REPLY_TOKENS = 8
# hop-by-hop and per-connection headers httpx sets itself; credentials the proxy redacted
NOT_REPLAYED = frozenset({"host", "content-length", "connection", "accept-encoding", "transfer-encoding",
                          "authorization", "x-api-key"})
TIMEOUT = 300

Json = dict[str, Any]


@pytest.fixture(scope="module")
def embedded() -> Iterator[LiveServer]:
    """A server as `mlx-relay serve` without flags runs it, under the embedded model's name and with
    its tokenizer and 32K context, on the fp32 random-weight fixture of that context: its prefill
    is 8x relay-tiny-agent's (hidden 64 and 4 layers against 256 and 8; 17.6 s against 140 s for
    Claude Code's cut request, 6,852 tokens, on the loaded 2-core CPU), and what is checked here is
    the shape of what the server accepts and answers, not what the model writes. No warm-up: the
    replays compile what they run."""
    model = fixture_path(FixtureSpec(variant="fp32", seed=0, max_position_embeddings=32768))
    config = default_config(model, served_model_name=AGENT_MODEL, max_num_seqs=2, max_queue=16, warmup=False)
    with LiveServer(config) as live:
        yield live


def shrink(value: Any, key: str | None = None) -> Any:
    """`value` with every string longer than TEXT_LIMIT (a `description`: DESCRIPTION_LIMIT) cut to
    it, except under KEEP_WHOLE keys."""
    if isinstance(value, str):
        limit = DESCRIPTION_LIMIT if key == "description" else TEXT_LIMIT
        return value if key in KEEP_WHOLE or len(value) <= limit else value[:limit]
    if isinstance(value, list):
        return [shrink(v, key) for v in value]
    if isinstance(value, dict):
        return {k: shrink(v, k) for k, v in value.items()}
    return value


def reply_field(path: str, body: Json) -> str:
    if path.startswith("/v1/responses"):
        return "max_output_tokens"
    if path.startswith("/v1/chat/completions") and "max_completion_tokens" in body:
        return "max_completion_tokens"
    return "max_tokens"


def replayed(fixture: Json) -> Json:
    body = shrink(copy.deepcopy(fixture["body"]))
    if not fixture["path"].startswith("/v1/messages/count_tokens"):
        name = reply_field(fixture["path"], body)
        body[name] = min(body.get(name) or REPLY_TOKENS, REPLY_TOKENS)
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int):
            body["max_tokens"] = thinking["budget_tokens"] + REPLY_TOKENS  # Anthropic: budget < max_tokens
    return body


def headers_of(fixture: Json) -> dict[str, str]:
    return {k: v for k, v in fixture["headers"].items() if k not in NOT_REPLAYED}


@pytest.mark.parametrize("case", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_agent_request_replays(embedded: LiveServer, case: Path) -> None:
    fixture = json.loads(case.read_text())
    path, headers = fixture["path"], headers_of(fixture)
    what = f"{fixture['agent']} {case.stem} {path}"
    body = replayed(fixture)
    streamed = body.get("stream") is True
    if path.startswith("/v1/chat/completions"):
        if streamed:
            chat_stream(embedded, body, headers, what)
        else:
            check_chat_completion(post_json(embedded, path, body, headers, what), body["model"])
    elif path.startswith("/v1/messages/count_tokens"):
        assert post_json(embedded, path, body, headers, what)["input_tokens"] > 0
    elif path.startswith("/v1/messages"):
        if streamed:
            messages_stream(embedded, body, headers, what, path)
        else:
            check_message(post_json(embedded, path, body, headers, what), body["model"])
    elif path.startswith("/v1/responses"):
        if streamed:
            responses_stream(embedded, body, headers, what)
        else:
            check_response(post_json(embedded, path, body, headers, what), body["model"])
    else:
        raise AssertionError(f"{what}: a route this test does not know")


def post_json(server: LiveServer, path: str, body: Json, headers: dict[str, str], what: str) -> Json:
    r = local_http.post(server.url + path, json=body, headers=headers, timeout=TIMEOUT)
    assert_ok(r, what)
    assert r.headers["content-type"].startswith("application/json"), r.headers["content-type"]
    return r.json()


def padded_past_the_context(fixture: Json) -> Json:
    """The agent's request with its last user text made longer than the context (about 40K tokens
    of the tiny vocabulary), the reply capped as in the replay."""
    body = copy.deepcopy(fixture["body"])
    body[reply_field(fixture["path"], body)] = REPLY_TOKENS
    last = next(m for m in reversed(body["messages"]) if m["role"] == "user")
    filler = "The quick brown fox jumps over the lazy dog. " * 3000
    if isinstance(last["content"], str):
        last["content"] += filler
    else:
        last["content"].append({"type": "text", "text": filler})
    return body


@pytest.mark.parametrize("agent", ["qwen-code", "claude-code"])
def test_a_prompt_past_the_context_gets_the_refusal_agents_read(embedded: LiveServer, agent: str) -> None:
    fixture = json.loads(sorted((FIXTURES / agent).glob("*.json"))[0].read_text())
    body = padded_past_the_context(fixture)
    r = local_http.post(embedded.url + fixture["path"], json=body, headers=headers_of(fixture), timeout=TIMEOUT)
    assert r.status_code == 400, f"{agent}: HTTP {r.status_code}: {r.text[:300]}"
    assert r.headers["content-type"].startswith("application/json")
    if fixture["api"] == "messages":
        answer = r.json()
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    else:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded", error
        assert error["param"] == "messages" and "maximum context length" in error["message"], error


def count_tokens(server: LiveServer, fixture: Json, body: Json) -> httpx.Response:
    return local_http.post(server.url + "/v1/messages/count_tokens", json=body, headers=headers_of(fixture),
                           timeout=TIMEOUT)


def test_tool_search_counts_only_the_tools_loaded(embedded: LiveServer) -> None:
    """Claude Code's tool search round trip (`claude-code-toolsearch/`, recorded against a scripted
    stub): count_tokens sees the prompt `/v1/messages` would. A deferred tool never referenced
    (Claude Code's `DeferredToolPlaceholder`) costs nothing: the first request counts as it would
    without it; once a tool_result references the MCP tool, it counts as a tool declared outright;
    a reference to a tool the request does not declare is a 400 in Anthropic's shape."""
    fixtures = [json.loads((FIXTURES / "claude-code-toolsearch" / f"{n}.json").read_text()) for n in ("001", "002")]
    bodies = [{k: v for k, v in shrink(copy.deepcopy(f["body"])).items() if k not in ("max_tokens", "stream")}
              for f in fixtures]
    for fixture, body in zip(fixtures, bodies, strict=True):
        outright = [{k: v for k, v in t.items() if k != "defer_loading"}
                    for t in body["tools"] if t["name"] != "DeferredToolPlaceholder"]
        as_sent = count_tokens(embedded, fixture, body)
        plain = count_tokens(embedded, fixture, {**body, "tools": outright})
        assert_ok(as_sent, "count_tokens")
        assert_ok(plain, "count_tokens")
        assert as_sent.json()["input_tokens"] == plain.json()["input_tokens"] > 0
    undeclared = [t for t in bodies[1]["tools"] if t["name"] != "mcp__stock__get_stock"]
    refused = count_tokens(embedded, fixtures[1], {**bodies[1], "tools": undeclared})
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", refused.text
    assert "mcp__stock__get_stock" in refused.json()["error"]["message"]


def test_every_agent_has_recorded_requests() -> None:
    """The five agents of issue 30 each left requests here (re-recorded with `make agents
    AGENTS_FLAGS=--save-fixtures`)."""
    agents = {p.parent.name for p in CASES}
    assert {"claude-code", "codex", "qwen-code", "opencode", "cline"} <= agents, sorted(agents)


#: The tool loops the agents recorded: each request is the one before, the model's call and the
#: tool's result (Claude Code's first request declares one tool fewer: its tool search loads the
#: MCP tool, so the second starts another prompt).
TOOL_LOOPS = {"qwen-code-toolsearch": ("001", "002", "003"), "claude-code-toolsearch": ("002", "003")}


@pytest.mark.parametrize("agent", sorted(TOOL_LOOPS))
def test_a_recorded_tool_loop_restores_the_previous_request(embedded: LiveServer, agent: str) -> None:
    """Issue 43: each round of a recorded tool loop restores the previous request's whole prompt
    (`cached_tokens` / `cache_read_input_tokens`). Claude Code's runs with thinking on and its
    recorded calls (a stub's) carry no thinking block, so the next prompt renders an empty one
    where the previous prompt ends inside `<think>\\n`: all but that newline is restored (`\\n\\n`
    is one token there)."""
    slack = 1 if agent.startswith("claude-code") else 0
    usages = []
    for stem in TOOL_LOOPS[agent]:
        fixture = json.loads((FIXTURES / agent / f"{stem}.json").read_text())
        body = replayed(fixture) | {"stream": False}
        answer = post_json(embedded, fixture["path"], body, headers_of(fixture), f"{agent} {stem}")
        usage = answer["usage"]
        if fixture["api"] == "messages":
            cached = usage["cache_read_input_tokens"]
            usages.append((usage["input_tokens"] + cached, cached))
        else:
            usages.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    for (prompt, _), (_, cached) in itertools.pairwise(usages):
        assert cached >= prompt - slack, usages

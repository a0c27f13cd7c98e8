"""Fuzzing every route, bounded for CI (issue 15, point 7): no input may produce a 5xx, a hang, a
body in the wrong error shape or a stream without its terminal event.

1. schemathesis, from the server's own `/openapi.json`: schema-valid bodies (positive) and
   schema-breaking ones (negative) for every operation; checked: no server error, the status
   codes, content types and JSON bodies the document declares. Generation is seeded
   (`derandomize`) so CI sees the same cases every run; `max_tokens`-like fields are capped in
   the fuzzed copy of the document so a case costs a few decoded tokens, not thousands.
2. Mutations of valid bodies, per POST route (wrong types, extreme numbers, deep nesting,
   invalid UTF-8, truncation, unknown fields, empty and huge strings): every answer is a 2xx or
   a 4xx in the route's own error shape, and every stream that starts ends with its terminal
   event.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.generation import GenerationMode

from mlx_relay.http.openapi import routes_not_described
from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

CHEAP = {"max_tokens": 6, "max_completion_tokens": 6, "max_output_tokens": 6, "n": 2, "top_logprobs": 3,
         "thinking_budget": 4, "budget_tokens": 4}


@pytest.fixture(scope="module")
def fuzzed(fp32_model: Path) -> Iterator[LiveServer]:
    config = default_config(fp32_model, served_model_name="tiny", model_aliases=("*",), max_num_seqs=4, max_queue=16,
                            warmup=False,
                            default_max_tokens=6, max_model_len=1024, read_timeout_s=5.0, render_timeout_s=20.0)
    with LiveServer(config) as live:
        yield live


def cap(node: Any) -> None:
    """In a copy of the document: every `max_tokens`-like integer at most a few tokens."""
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            for name, limit in CHEAP.items():
                if isinstance(props.get(name), dict):
                    props[name] = {**props[name], "maximum": limit}
        for value in node.values():
            cap(value)
    elif isinstance(node, list):
        for value in node:
            cap(value)


def test_the_document_describes_every_route(fuzzed: LiveServer) -> None:
    from mlx_relay.http.app import create_app

    assert routes_not_described(create_app(fuzzed.config).routes) == []
    doc = local_http.get(fuzzed.url + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.1") and "/v1/chat/completions" in doc["paths"]
    schemathesis.openapi.from_dict(doc)  # loads as a valid document


def operations(url: str) -> list[Any]:
    doc = local_http.get(url + "/openapi.json", timeout=30).json()
    cap(doc)
    schema = schemathesis.openapi.from_dict(doc)
    return [result.ok() for result in schema.get_all_operations()]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz(op: Any, mode: GenerationMode, url: str, failures: list[str], statuses: list[int]) -> None:
    """`max_examples` seeded cases of one operation, each sent and checked."""

    @hypothesis.settings(max_examples=12, derandomize=True, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, timeout=60)
        statuses.append(response.status_code)
        if mode is GenerationMode.POSITIVE and response.status_code == 422:  # the document and the decoder disagree
            failures.append(f"{op.method.upper()} {op.path}: schema-valid body refused: {response.text[:300]}\n"
                            f"  body: {str(case.body)[:300]}")
        try:
            case.validate_response(response, checks=CHECKS)
        except AssertionError as exc:
            failures.append(f"{op.method.upper()} {op.path}: {str(exc)[:400]}\n  body: {str(case.body)[:300]}")

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(fuzzed: LiveServer, mode: GenerationMode) -> None:
    failures: list[str] = []
    statuses: list[int] = []
    for op in operations(fuzzed.url):
        # an operation without a body has no negative case a URL can carry
        if op.path != "/openapi.json" and (mode is GenerationMode.POSITIVE or op.body):
            fuzz(op, mode, fuzzed.url, failures, statuses)
    assert not failures, "\n".join(failures[:10])
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    assert len(statuses) >= 80, counts  # the cases really reached the server
    assert 200 in counts if mode is GenerationMode.POSITIVE else any(400 <= s < 500 for s in counts), counts
    print(mode.value, counts)


# -- mutations of valid bodies ----------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}}}]
USER = [{"role": "user", "content": "Read src/main.py"}]
VALID: dict[str, list[dict[str, Any]]] = {
    "/v1/chat/completions": [
        {"model": "tiny", "messages": USER, "max_tokens": 4},
        {"model": "tiny", "messages": USER, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}},
        {"model": "tiny", "messages": USER, "max_tokens": 24, "tools": TOOLS, "tool_choice": "required"},
        {"model": "tiny", "messages": USER, "max_tokens": 8, "response_format": {"type": "json_object"},
         "logprobs": True, "top_logprobs": 2, "seed": 1},
    ],
    "/v1/completions": [{"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, "stream": True}],
    "/v1/messages": [
        {"model": "tiny", "max_tokens": 4, "messages": USER, "system": "Be brief."},
        {"model": "tiny", "max_tokens": 24, "messages": USER, "stream": True,
         "tools": [{"name": "read_file", "input_schema": TOOLS[0]["function"]["parameters"]}],
         "tool_choice": {"type": "any"}},
    ],
    "/v1/messages/count_tokens": [{"model": "tiny", "messages": USER}],
    "/v1/responses": [{"model": "tiny", "input": "Say hi.", "max_output_tokens": 4, "stream": True},
                      {"model": "tiny", "input": "Say hi.", "max_output_tokens": 4, "instructions": "Be brief."}],
}

ODD_VALUES: list[Any] = [None, True, -1, 0, 2**64, -(2**63), 1e308, -1e308, 0.5, "", "x" * 5000, "\u0000",
                         "\ud7ff\U0010ffff", [], {}, [None], {"": {}}, "NaN", [[[[[[[[[[[[]]]]]]]]]]]]]


def mutate(body: dict[str, Any], rng: random.Random) -> bytes:
    """One seeded mutation of a valid body, as the bytes sent."""
    body = copy.deepcopy(body)
    kind = rng.randrange(9)
    paths = list(_paths(body))
    if kind == 0 and paths:  # a value replaced by an odd one
        parent, key = rng.choice(paths)
        parent[key] = rng.choice(ODD_VALUES)
    elif kind == 1 and paths:  # a field dropped
        parent, key = rng.choice(paths)
        del parent[key]
    elif kind == 2:  # an unknown field
        body[rng.choice(["extra", "__proto__", "stream_options", "user", "metadata"])] = rng.choice(ODD_VALUES)
    elif kind == 3:  # truncated JSON
        raw = json.dumps(body).encode()
        return raw[: rng.randrange(1, len(raw))]
    elif kind == 4:  # invalid UTF-8 inside a string
        return json.dumps(body).encode().replace(b"Read", b"R\xff\xfed", 1)
    elif kind == 5:  # deep nesting somewhere free-form
        body["metadata" if rng.random() < 0.5 else "chat_template_kwargs"] = json.loads("[" * 200 + "]" * 200)
    elif kind == 6:  # the conversation emptied or repeated
        body["messages" if "messages" in body else "input"] = rng.choice([[], USER * 40, "", [{"role": "tool"}]])
    elif kind == 7:  # not an object at all
        return rng.choice([b"[]", b"null", b"42", b'"text"', b"", b"{"])
    else:  # numbers at their edges
        for key in ("temperature", "top_p", "top_k", "presence_penalty", "repetition_penalty", "max_tokens"):
            if rng.random() < 0.4:
                body[key] = rng.choice([-1, 0, 1e9, -1e-9, 2**31])
    return json.dumps(body).encode()


def _paths(node: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield node, key
            yield from _paths(value)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield node, i
            yield from _paths(value)


def terminal_check(path: str) -> Callable[[list[str]], bool]:
    """Whether a stream's last lines are its route's terminal event."""
    if path.startswith("/v1/messages"):
        return lambda lines: any(x in lines[-1] for x in ('"message_stop"', '"error"')) if lines else False
    if path.startswith("/v1/responses"):
        ends = ("response.completed", "response.incomplete", "response.failed")
        return lambda lines: bool(lines) and any(e in lines[-1] for e in ends)
    return lambda lines: bool(lines) and lines[-1] == "data: [DONE]"


def error_shape_ok(path: str, body: Any) -> bool:
    if path.startswith("/v1/messages"):
        return isinstance(body, dict) and body.get("type") == "error" and {"type", "message"} <= set(body["error"])
    return isinstance(body, dict) and {"message", "type", "param", "code"} <= set(body.get("error", {}))


def test_mutated_bodies_get_2xx_or_a_shaped_4xx_and_streams_end(fuzzed: LiveServer) -> None:
    rng = random.Random(15)
    failures: list[str] = []
    with httpx.Client(timeout=60) as client:
        for path, bodies in VALID.items():
            for i in range(24):
                raw = mutate(bodies[i % len(bodies)], rng)
                with client.stream("POST", fuzzed.url + path, content=raw,
                                   headers={"content-type": "application/json"}) as r:
                    lines = [line for line in r.iter_lines() if line.strip()]
                status, ctype = r.status_code, r.headers.get("content-type", "")
                where = f"{path} {status} <- {raw[:200]!r}"
                if status >= 500:
                    failures.append(where + f": {lines[:2]}")
                elif status >= 400 and not error_shape_ok(path, json.loads("\n".join(lines))):
                    failures.append(where + f": error shape {lines[:2]}")
                elif status == 200 and ctype.startswith("text/event-stream") and not terminal_check(path)(lines):
                    failures.append(where + f": stream ended with {lines[-2:]}")
    assert not failures, "\n".join(failures[:10])
    health = local_http.get(fuzzed.url + "/health", timeout=10)
    assert health.status_code == 200 and "down" not in health.json()

"""One structured log line per request (`http/request_log.py`) and the `x-request-id` round trip,
on the shared live server: a chat, a stream, a 4xx, a stream the client leaves; the text and
json formats; no prompt text unless `--log-prompts` (that and the drain's lines: test_drain.py)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from mlx_relay.log_format import JsonFormatter, TextFormatter
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

LOGGER = "mlx_relay.requests"
SECRET = "zebra-quartz-1729"  # a word of the prompt that must not reach the log
FIELDS = {"request_id", "method", "route", "model", "status", "stream", "prompt_tokens", "cached_tokens",
          "completion_tokens", "ttft_s", "duration_s", "finish_reason", "error", "error_type", "response_id"}


@pytest.fixture
def request_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        yield caplog


def lines(caplog: pytest.LogCaptureFixture, rid: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and getattr(r, "fields", {}).get("request_id") == rid]


def line(caplog: pytest.LogCaptureFixture, rid: str) -> dict[str, Any]:
    """The request's one line (it is written when the request is over, maybe after the client
    has read the answer: wait for it)."""
    deadline = time.monotonic() + 30
    while not lines(caplog, rid):
        assert time.monotonic() < deadline, f"no log line for {rid}"
        time.sleep(0.02)
    found = lines(caplog, rid)
    assert len(found) == 1, [r.fields for r in found]  # type: ignore[attr-defined]
    fields: dict[str, Any] = found[0].fields  # type: ignore[attr-defined]
    assert set(fields) == FIELDS, "no prompt or reply text without --log-prompts"
    assert SECRET not in TextFormatter().format(found[0])
    return fields


def user(text: str = f"Say {SECRET}.") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_a_chat_logs_one_line_with_its_accounting_under_the_clients_request_id(
        server: LiveServer, request_log: pytest.LogCaptureFixture) -> None:
    r = local_http.post(server.url + "/v1/chat/completions", headers={"x-request-id": "agent-7/turn:3"},
                   json={"model": "tiny", "messages": user(), "max_tokens": 6, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "agent-7/turn:3"
    usage = r.json()["usage"]
    fields = line(request_log, "agent-7/turn:3")
    assert fields["method"] == "POST" and fields["route"] == "/v1/chat/completions" and fields["model"] == "tiny"
    assert fields["status"] == 200 and fields["stream"] is False and fields["response_id"] == r.json()["id"]
    assert fields["prompt_tokens"] == usage["prompt_tokens"] and fields["completion_tokens"] == usage[
        "completion_tokens"]
    assert fields["cached_tokens"] == (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert fields["finish_reason"] == r.json()["choices"][0]["finish_reason"]
    assert 0 < fields["ttft_s"] <= fields["duration_s"]
    assert fields["error"] is None and fields["error_type"] is None
    # the json format: one object per line, the fields beside time, level, logger and message
    record = lines(request_log, "agent-7/turn:3")[0]
    obj = json.loads(JsonFormatter().format(record))
    assert obj["logger"] == LOGGER and obj["level"] == "INFO" and {k: obj[k] for k in FIELDS} == fields
    text = TextFormatter().format(record)
    assert "\n" not in text and "request_id=agent-7/turn:3 " in text and " status=200 " in text


def test_a_stream_logs_one_line_and_carries_the_request_id(server: LiveServer,
                                                          request_log: pytest.LogCaptureFixture) -> None:
    body = {"model": "tiny", "messages": user(), "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with local_http.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert len(rid) == 32  # none sent: a fresh one
    fields = line(request_log, rid)
    assert fields["stream"] is True and fields["status"] == 200 and fields["error"] is None
    assert fields["completion_tokens"] == chunks[-1]["usage"]["completion_tokens"]
    assert fields["finish_reason"] == next(c["choices"][0]["finish_reason"] for c in chunks
                                           if c["choices"] and c["choices"][0]["finish_reason"])


def test_errors_log_their_type_and_a_bad_request_id_is_replaced(server: LiveServer,
                                                                request_log: pytest.LogCaptureFixture) -> None:
    too_long = "x" * 129
    r = local_http.post(server.url + "/v1/chat/completions", headers={"x-request-id": too_long},
                   json={"model": "tiny", "messages": user(), "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    rid = r.headers["x-request-id"]
    assert rid != too_long and len(rid) == 32
    fields = line(request_log, rid)
    assert fields["status"] == 400 and fields["error"] == "InvalidRequest"
    assert fields["error_type"] == "invalid_request_error" and fields["model"] == "tiny"
    assert fields["completion_tokens"] == 0 and fields["finish_reason"] is None
    # Anthropic's shape, an unknown route: the header and the line all the same
    r = local_http.post(server.url + "/v1/messages", headers={"x-request-id": "claude\x7f"},
                   json={"model": "tiny", "max_tokens": 4, "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error" and r.headers["x-request-id"] != "claude\x7f"
    assert line(request_log, r.headers["x-request-id"])["error_type"] == "invalid_request_error"
    # a model this server does not serve: the line names the one asked for
    r = local_http.post(server.url + "/v1/chat/completions", headers={"x-request-id": "other-model"},
                   json={"model": "other", "messages": user(), "max_tokens": 2}, timeout=60)
    assert r.status_code == 404
    fields = line(request_log, "other-model")
    assert fields["model"] == "other" and fields["error"] == "ModelNotFound" and fields["status"] == 404
    r = local_http.get(server.url + "/v1/nothing-here", headers={"x-request-id": "probe-1"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "probe-1"
    assert line(request_log, "probe-1")["error"] == "NotFound"


def test_health_probes_log_at_debug(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        r = local_http.get(server.url + "/health", headers={"x-request-id": "probe-2"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "probe-2"
        assert line(caplog, "probe-2")["route"] == "/health"
        assert lines(caplog, "probe-2")[0].levelno == logging.DEBUG


def test_requests_the_client_leaves_log_once(server: LiveServer, request_log: pytest.LogCaptureFixture) -> None:
    endless = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 20000}}, "required": ["s"]}}}
    body = {"model": "tiny", "messages": user(), "max_tokens": 3000, "response_format": endless}
    with pytest.raises(httpx.TimeoutException):  # the client gives up on a non-streamed answer
        local_http.post(server.url + "/v1/chat/completions", json=body, headers={"x-request-id": "gone-0"}, timeout=0.5)
    fields = line(request_log, "gone-0")
    assert fields["status"] == 499 and fields["error"] == "ClientDisconnected" and fields["completion_tokens"] > 0
    body["stream"] = True
    with local_http.stream("POST", server.url + "/v1/chat/completions", json=body, headers={"x-request-id": "gone-1"},
                      timeout=60) as r:
        assert r.headers["x-request-id"] == "gone-1"
        for n, _ in enumerate(r.iter_lines()):
            if n > 8:
                break  # leave mid-stream
    fields = line(request_log, "gone-1")
    assert fields["status"] == 200 and fields["error"] == "ClientDisconnected"
    assert fields["error_type"] == "client_disconnected" and fields["finish_reason"] is None
    assert fields["completion_tokens"] > 0 and fields["ttft_s"] is not None
    # a later request is logged too, and the one that was left still has one line
    local_http.get(server.url + "/v1/models", headers={"x-request-id": "after-1"})
    assert line(request_log, "after-1")["status"] == 200
    assert len(lines(request_log, "gone-1")) == 1


def test_the_text_format_keeps_a_line_one_line() -> None:
    record = logging.LogRecord(LOGGER, logging.INFO, __file__, 1, "request", None, None)
    record.fields = {"a": None, "b": True, "c": 0.25, "d": 'two words "quoted"\nand a newline', "e": ["x y"]}
    text = TextFormatter().format(record)
    assert text == 'INFO mlx_relay.requests: request a=- b=true c=0.25 d="two words \\"quoted\\"\\nand a newline" ' \
                   'e="[\\"x y\\"]"'
    assert json.loads(JsonFormatter().format(record))["d"] == record.fields["d"]


def test_a_named_server_s_lines_carry_its_name() -> None:
    """`--log-name` (the cluster names its replicas replica-1, ...): first on a text line, `server`
    in a JSON one, so the lines of processes sharing a stream can be told apart."""
    record = logging.LogRecord(LOGGER, logging.INFO, __file__, 1, "request", None, None)
    record.fields = {"request_id": "s3.t1"}
    assert TextFormatter("replica-2").format(record) == "replica-2 INFO mlx_relay.requests: request request_id=s3.t1"
    obj = json.loads(JsonFormatter("replica-2").format(record))
    assert obj["server"] == "replica-2" and obj["request_id"] == "s3.t1"
    assert "server" not in json.loads(JsonFormatter().format(record))

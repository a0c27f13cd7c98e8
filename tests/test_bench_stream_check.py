"""The HTTP driver reads and checks streams from a scripted double of an HTTP server: every
deliberately broken stream is counted as its own violation kind; a well-formed one has none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mlx_relay.bench.client import HttpDriver, api_base, request_body
from mlx_relay.bench.double import DoubleServer
from mlx_relay.bench.records import Measurement
from mlx_relay.bench.workload import BenchRequest
from mlx_relay.testing.live_server import free_port

REQUEST = BenchRequest(id="r0", scenario="t", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                       temperature=0.0)


@pytest.fixture(scope="module")
def double() -> Iterator[DoubleServer]:
    with DoubleServer() as server:
        yield server


async def send(url: str, request: BenchRequest = REQUEST) -> tuple[Measurement, str]:
    async with HttpDriver.open(url, timeout_s=10) as driver:
        outcome = await driver.send(request)
    return outcome.measurement, outcome.text


async def test_a_well_formed_stream_has_no_violations(double: DoubleServer) -> None:
    m, text = await send(double.url + "/good")
    assert m.error is None and m.violations == []
    assert text == "w0 w1 w2 w3 w4 " and m.content_chunks == 5 and len(m.itl_s) == 4
    assert (m.prompt_tokens, m.completion_tokens, m.cached_tokens, m.finish_reason) == (7, 5, 3, "length")
    assert m.ttft_s is not None and m.e2e_s is not None and 0 < m.ttft_s <= m.e2e_s


@pytest.mark.parametrize(("mode", "violation"), [
    ("no_finish", "missing_finish_reason"),
    ("no_done", "missing_done"),
    ("bad_json", "malformed_json"),
    ("after_done", "data_after_done"),
    ("double_finish", "multiple_finish_reasons"),
    ("bad_shape", "bad_chunk_shape"),
])
async def test_each_broken_stream_is_counted_as_its_kind(double: DoubleServer, mode: str, violation: str) -> None:
    m, _ = await send(f"{double.url}/{mode}")
    assert m.violations == [violation]
    assert m.error == "stream_violation"
    assert m.content_chunks == 5  # the rest of the stream was still read and timed


@pytest.mark.parametrize(("mode", "violation"), [("no_usage", "missing_usage"), ("no_object", "missing_object")])
async def test_minor_violations_are_counted_but_the_answer_is_measured(
        double: DoubleServer, mode: str, violation: str) -> None:
    m, _ = await send(f"{double.url}/{mode}")
    assert m.violations == [violation] and m.error is None


@pytest.mark.parametrize(("mode", "error"), [
    ("status_400", "http_4xx"), ("status_429", "http_429"), ("status_500", "http_5xx"),
    ("error_frame", "stream_error"), ("drop", "connection"),
])
async def test_failed_requests_are_error_kinds_not_crashes(double: DoubleServer, mode: str, error: str) -> None:
    m, _ = await send(f"{double.url}/{mode}")
    assert m.error == error and m.violations == []
    assert m.error_detail


async def test_not_a_stream_and_nobody_listening(double: DoubleServer) -> None:
    m, _ = await send(double.url + "/not_sse")
    assert m.error == "stream_violation" and "not_event_stream" in m.violations
    m, _ = await send(f"http://127.0.0.1:{free_port()}")
    assert m.error == "connection"


async def test_request_body_and_model_discovery(double: DoubleServer) -> None:
    async with HttpDriver.open(double.url + "/good/v1/") as driver:
        assert driver.model == "double" and driver.chat_url == double.url + "/good/v1/chat/completions"
    assert api_base("http://h:1") == "http://h:1/v1" == api_base("http://h:1/v1/")
    seeded = BenchRequest(id="x", scenario="t", messages=[], max_tokens=3, temperature=0.5, seed=9,
                          tools=[{"type": "function", "function": {"name": "f"}}])
    body = request_body(seeded, "m")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["model"], body["seed"], body["max_tokens"], body["temperature"]) == ("m", 9, 3, 0.5)
    assert "seed" not in request_body(REQUEST, None) and "model" not in request_body(REQUEST, None)

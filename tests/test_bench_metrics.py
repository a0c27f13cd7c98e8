"""Bench metrics on known synthetic records and a known stream: exact percentiles, throughput,
goodput, error and violation counts, ratios across targets."""

from __future__ import annotations

import pytest

from mlx_relay.bench.metrics import Slo, meets_slo, metric, percentile, ratios, stats, summarize
from mlx_relay.bench.records import RequestRecord
from mlx_relay.bench.sse_check import StreamChecker


def rec(i: int, **kw: object) -> RequestRecord:
    base: dict[str, object] = {"request_id": f"r{i}", "scenario": "s", "target": "A", "level": "c=1",
                               "start_s": float(i)}
    return RequestRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_percentiles_interpolate_linearly() -> None:
    xs = [float(x) for x in range(1, 11)]
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile(list(reversed(xs)), 50) == pytest.approx(5.5)  # order does not matter
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    s = stats([2.0, 4.0, 6.0, 8.0])
    assert (s.n, s.mean, s.p50, s.max) == (4, 5.0, 5.0, 8.0)
    assert s.p90 == pytest.approx(7.4) and s.p99 == pytest.approx(7.94)
    assert stats([]).p50 is None


def synthetic() -> list[RequestRecord]:
    """Four good requests (TTFT 100..400 ms, ITL 10/20 ms, 10 tokens each) and three failures."""
    good = [
        rec(i, ttft_s=0.1 * (i + 1), itl_s=[0.01, 0.02] if i < 2 else [0.02, 0.04], e2e_s=0.5 + 0.1 * i,
            prompt_tokens=20, completion_tokens=10, cached_tokens=5, content_chunks=3, finish_reason="length")
        for i in range(4)
    ]
    bad = [
        rec(4, error="http_429", error_detail="HTTP 429"),
        rec(5, error="timeout"),
        rec(6, error="stream_violation", violations=["missing_done", "malformed_json"], ttft_s=0.05,
            completion_tokens=99),
    ]
    minor = rec(7, ttft_s=0.2, itl_s=[0.01], e2e_s=0.3, content_chunks=2, violations=["missing_usage"])
    return [*good, *bad, minor]


def test_summary_of_synthetic_records() -> None:
    s = summarize(synthetic(), elapsed_s=2.0)
    assert (s.requests, s.ok) == (8, 5)
    assert s.errors == {"http_429": 1, "stream_violation": 1, "timeout": 1}
    assert s.violations == {"malformed_json": 1, "missing_done": 1, "missing_usage": 1}
    # throughput counts successful requests only; no usage -> content chunks count as tokens
    assert s.req_per_s == pytest.approx(2.5)
    assert s.completion_tokens == 4 * 10 + 2
    assert s.output_tok_per_s == pytest.approx(21.0)
    assert s.total_tok_per_s == pytest.approx((80 + 42) / 2)
    assert (s.prompt_tokens, s.cached_tokens) == (80, 20)
    # TTFT of the ok requests: 100, 200, 300, 400, 200 ms
    assert s.ttft_ms.n == 5 and s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.ttft_ms.p90 == pytest.approx(360.0) and s.ttft_ms.p99 == pytest.approx(396.0)
    # ITLs: 10, 20, 10, 20, 20, 40, 20, 40, 10 ms
    assert s.itl_ms.n == 9 and s.itl_ms.p50 == pytest.approx(20.0) and s.itl_ms.max == pytest.approx(40.0)
    assert s.e2e_ms.p50 == pytest.approx(600.0)  # 300, 500, 600, 700, 800 ms
    assert s.goodput_req_per_s is None and s.slo_met is None  # no objective set


def test_goodput_counts_requests_meeting_every_objective() -> None:
    records = synthetic()
    # TTFT <= 250 ms: requests 0, 1 and the minor one; mean ITL <= 20 ms: 0, 1 (15 ms), minor (10 ms)
    s = summarize(records, elapsed_s=2.0, slo=Slo(ttft_ms=250, itl_ms=20))
    assert s.slo_met == 3 and s.goodput_req_per_s == pytest.approx(1.5)
    assert summarize(records, 2.0, Slo(itl_ms=20)).slo_met == 3  # 0, 1, minor; 2 and 3 average 30 ms
    assert summarize(records, 2.0, Slo(e2e_ms=600)).slo_met == 3  # 500, 600 ms and the minor 300 ms
    assert not meets_slo(records[4], Slo(ttft_ms=1e9))  # a failed request never meets an objective
    one_chunk = rec(9, ttft_s=0.1, e2e_s=0.1, content_chunks=1)
    assert meets_slo(one_chunk, Slo(itl_ms=1))  # no inter-token gap to miss


def test_ratios_and_empty_inputs() -> None:
    a = summarize(synthetic()[:4], elapsed_s=2.0)
    b = summarize(synthetic()[:4], elapsed_s=1.0)
    r = ratios(a, b)
    assert r["req_per_s"] == pytest.approx(2.0) and r["ttft_ms.p50"] == pytest.approx(1.0)
    assert r["goodput_req_per_s"] is None
    empty = summarize([], elapsed_s=0.0)
    assert (empty.requests, empty.req_per_s, empty.ttft_ms.p50) == (0, 0.0, None)
    assert metric(empty, "ttft_ms.p50") is None and ratios(empty, a)["req_per_s"] is None


def test_a_known_stream_gives_exact_timings() -> None:
    lines = [
        'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
        "",
        ": keep-alive",
        'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}',
        'data:{"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}',
        'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"!"},"finish_reason":null}]}',
        'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m",'
        '"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"m","choices":[],'
        '"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14,'
        '"prompt_tokens_details":{"cached_tokens":8}}}',
        "data: [DONE]",
        "",
    ]
    times = [0.01, 0.01, 0.02, 0.25, 0.30, 0.40, 0.41, 0.42, 0.43, 0.43]
    checker = StreamChecker()
    for line, t in zip(lines, times, strict=True):
        checker.feed(line, t)
    m = checker.close(0.45)
    assert m.error is None and m.violations == []
    assert m.ttft_s == pytest.approx(0.25)
    assert m.itl_s == pytest.approx([0.05, 0.10])
    assert (m.e2e_s, m.content_chunks, m.finish_reason) == (0.45, 3, "stop")
    assert (m.prompt_tokens, m.completion_tokens, m.cached_tokens) == (11, 3, 8)
    assert checker.text == "Hello!"

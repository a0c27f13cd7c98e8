"""`GET /metrics` (Prometheus text format, issue: running it for real, point 1): the shared live
server scraped and parsed with prometheus-client's own parser; vLLM's names under `mlx_relay:`
with the served model as `model_name`; the counters and histograms move by what the requests
report in their usage; each server's registry is its own."""

from __future__ import annotations

import time

import httpx
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from mlx_relay.chat.output import INVALID_REASONS
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import FunctionDef, ToolDef
from mlx_relay.messages.admission import REJECT_REASONS, AdmissionStats
from mlx_relay.messages.text_mtp import MTPStats
from mlx_relay.metrics import ServerMetrics, StatsSnapshot
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer
from tests.test_vision_path import image_message, png_data_url

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# the vLLM names operators already scrape (`vllm:` -> `mlx_relay:`)
VLLM_NAMES = {"num_requests_running": "gauge", "num_requests_waiting": "gauge",
              "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
              "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
              "prompt_tokens": "counter", "generation_tokens": "counter", "request_success": "counter",
              "prefix_cache_queries": "counter", "prefix_cache_hits": "counter",
              "spec_decode_num_draft_tokens": "counter", "spec_decode_num_accepted_tokens": "counter"}
OURS = {"admission_rejections": "counter", "server_state": "gauge", "gpu_memory_bytes": "gauge",
        "gpu_memory_peak_bytes": "gauge", "prefix_cache_snapshot_bytes": "gauge", "prefix_cache_snapshots": "gauge",
        "mtp_requests": "counter", "context_draft_requests": "counter", "vision_cache_queries": "counter",
        "vision_cache_hits": "counter", "vision_cache_bytes": "gauge", "tool_calls_invalid": "counter"}


def scrape(url: str, **headers: str) -> tuple[dict[str, str], Samples]:
    """(family name -> type, (sample name, labels) -> value), through prometheus-client's parser."""
    r = local_http.get(url + "/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[("mlx_relay:" + name, frozenset({"model_name": "tiny", **labels}.items()))]


def idle(url: str) -> None:
    deadline = time.monotonic() + 30
    while local_http.get(url + "/health", timeout=10).json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)


def test_scrape_names_labels_and_counters_that_move(server: LiveServer) -> None:
    idle(server.url)
    _, before = scrape(server.url)
    system = "You review patches for the metrics endpoint, line by line, and say what is wrong. " * 12
    turns = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    usages = []
    for content in ("first", "second"):  # the second restores the first's system-prompt snapshot
        turns[1] = {"role": "user", "content": content}
        r = local_http.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": turns, "max_tokens": 6, "temperature": 0})
        usages.append(r.json()["usage"])
    with local_http.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "stream it"}], "max_tokens": 5,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        last = [ln for ln in r.iter_lines() if ln.startswith("data: {")][-1]
    usages.append(httpx.Response(200, content=last[len("data: "):]).json()["usage"])
    url = png_data_url(31)
    for text in ("one", "two"):  # the same image twice: its features are reused
        r = local_http.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": image_message(text, url), "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    types, after = scrape(server.url)

    for name, kind in {**VLLM_NAMES, **OURS}.items():
        assert types.get("mlx_relay:" + name) == kind, name
    assert all(n.startswith("mlx_relay:") for n in types)
    assert all(dict(labels).get("model_name") == "tiny" for _, labels in after)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    n = len(usages)
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] > 256
    assert moved("prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert moved("prefix_cache_queries_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("prefix_cache_hits_total") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert moved(hist + "_count") == n, hist
        assert moved(hist + "_bucket", le="+Inf") == n, hist
    itl = moved("inter_token_latency_seconds_count")
    assert 0 < itl <= sum(u["completion_tokens"] for u in usages) - n  # every token after a reply's first
    assert moved("request_success_total", finished_reason="length") + moved(
        "request_success_total", finished_reason="stop") == n
    mtp = [u["mtp"] for u in usages if "mtp" in u]
    assert mtp and moved("spec_decode_num_draft_tokens_total", source="mtp") == sum(m["draft_tokens"] for m in mtp)
    assert moved("spec_decode_num_accepted_tokens_total", source="mtp") == sum(m["accepted_tokens"] for m in mtp)
    for source in ("mtp", "context"):  # the drafts per source, as the usages report them
        counts = [u["speculation"][source] for u in usages if source in u.get("speculation", {})]
        assert moved("spec_decode_num_draft_tokens_total", source=source) == sum(c["drafted"] for c in counts)
        assert moved("spec_decode_num_accepted_tokens_total", source=source) == sum(c["accepted"] for c in counts)
    context = sum("context" in u.get("speculation", {}) for u in usages)
    assert context <= moved("context_draft_requests_total") <= 3  # planned with context drafts: text requests only
    assert moved("vision_cache_hits_total") >= 1 and moved("vision_cache_queries_total") >= 2
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0
    assert value(after, "server_state", state="ready") == 1 and value(after, "server_state", state="loading") == 0
    assert {dict(labels)["reason"] for name, labels in after
            if name == "mlx_relay:admission_rejections_total"} == set(REJECT_REASONS)
    assert {dict(labels)["reason"] for name, labels in after
            if name == "mlx_relay:tool_calls_invalid_total"} == set(INVALID_REASONS)
    assert value(after, "gpu_memory_bytes", kind="active") > 0
    kinds = {dict(labels)["kind"] for name, labels in after if name == "mlx_relay:gpu_memory_bytes"}
    assert kinds == {"active", "cache"}  # the CUDA pool's kinds only where MLX runs on CUDA (not here)
    assert value(after, "prefix_cache_snapshot_bytes", tier="memory") > 0


def test_metrics_route_errors_and_document(server: LiveServer) -> None:
    r = local_http.post(server.url + "/metrics", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    doc = local_http.get(server.url + "/openapi.json", timeout=10).json()
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]


def test_what_a_model_writes_wrong_in_a_call_is_counted_by_reason() -> None:
    """The reply parser reports each wrong call (delivered as written, or as text) to the
    request metrics, as `ChatService.reply` wires it: a counter per reason, no error."""
    m = ServerMetrics("tiny")
    tool = ToolDef(FunctionDef("read_file", parameters={"type": "object", "properties": {"path": {"type": "string"}},
                                                        "required": ["path"]}))
    parser = ReplyParser(tools=[tool], on_invalid=m.requests.tool_call_invalid)
    text = ("</tool_call>\n<tool_call>\n<function=rm>\n</function>\n</tool_call>"
            "<tool_call>\n<function=read_file>\n</function>\n</tool_call><tool_call>oops</tool_call>")
    events = parser.feed(text) + parser.finish()
    assert [type(e).__name__ for e in events].count("ToolCallEnd") == 2
    stats = StatsSnapshot("ready", AdmissionStats("ready", "", 1, 0, 8, 32, 0, dict.fromkeys(REJECT_REASONS, 0)))
    after = {(s.name, frozenset(s.labels.items())): s.value
             for f in text_string_to_metric_families(m.render(stats).decode()) for s in f.samples}
    counts = {reason: value(after, "tool_calls_invalid_total", reason=reason) for reason in INVALID_REASONS}
    assert counts == {"undeclared_tool": 1, "schema_mismatch": 1, "unreadable": 1, "unclosed": 0, "stray_markup": 1}


def test_each_server_has_its_own_registry() -> None:
    """Two servers in one process: no clash, no shared series, nothing in prometheus-client's
    global registry."""
    a, b = ServerMetrics("tiny"), ServerMetrics("tiny")
    a.requests.clock(0.0, 7)
    stats = StatsSnapshot("ready", AdmissionStats("ready", "", 1, 2, 8, 32, 5, dict.fromkeys(REJECT_REASONS, 0)))

    def samples(m: ServerMetrics) -> Samples:
        return {(s.name, frozenset(s.labels.items())): s.value
                for f in text_string_to_metric_families(m.render(stats).decode()) for s in f.samples}

    assert value(samples(a), "prompt_tokens_total") == 7 and value(samples(b), "prompt_tokens_total") == 0
    assert value(samples(a), "num_requests_waiting") == 2
    assert not any(f.name.startswith("mlx_relay:") for f in REGISTRY.collect())


def test_draft_counters_by_source() -> None:
    """The TextMTPExecutor's counters: drafts verified and accepted by source (the head's, the
    context's), the requests planned with context drafts, and the warm-up's round cost."""
    mtp = MTPStats(True, 2, planned=5, declined=1, requests=5, rounds=9, drafted=9, accepted=4, context_planned=3,
                   context_drafted=12, context_accepted=7, round_cost=1.25)
    stats = StatsSnapshot("ready", AdmissionStats("ready", "", 1, 0, 8, 32, 0, dict.fromkeys(REJECT_REASONS, 0)),
                          mtp=mtp)
    after = {(s.name, frozenset(s.labels.items())): s.value
             for f in text_string_to_metric_families(ServerMetrics("tiny").render(stats).decode()) for s in f.samples}
    assert value(after, "spec_decode_num_draft_tokens_total", source="mtp") == 9
    assert value(after, "spec_decode_num_accepted_tokens_total", source="mtp") == 4
    assert value(after, "spec_decode_num_draft_tokens_total", source="context") == 12
    assert value(after, "spec_decode_num_accepted_tokens_total", source="context") == 7
    assert value(after, "context_draft_requests_total") == 3
    assert value(after, "mtp_requests_total", decision="mtp") == 5
    assert value(after, "mtp_round_cost_steps") == 1.25  # the warm-up's calibration (absent without one)

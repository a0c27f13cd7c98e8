"""The bench harness end to end on the real engine (the float32 tiny model): over HTTP against
our server, through the CLI, and in-process through the Relay's service without HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from mlx_relay.bench.client import HttpDriver
from mlx_relay.bench.inprocess import InProcessDriver
from mlx_relay.bench.metrics import Slo, summarize
from mlx_relay.bench.report import TargetInfo, build_report, write_report
from mlx_relay.bench.runner import BenchResult, BenchRun, Level, RunConfig
from mlx_relay.bench.scenario import load_scenario
from mlx_relay.bench.session import session_request
from mlx_relay.bench.workload import ChatJob, SessionJob, build_jobs
from mlx_relay.cli import main
from mlx_relay.relay import Relay
from mlx_relay.testing.live_server import LiveServer


async def run_short_chat(url: str) -> tuple[BenchRun, BenchResult, HttpDriver]:
    async with HttpDriver.open(url) as target:
        run = BenchRun(load_scenario("short_chat"), [target],
                       RunConfig(levels=[Level(concurrency=2)], max_requests=8))
        return run, await run.run(), target


async def test_closed_loop_against_our_server(server: LiveServer, tmp_path: Path) -> None:
    run, result, target = await run_short_chat(server.url)
    assert target.model == "tiny" and result.stop_reason == "completed"
    (lr,) = result.results
    s = summarize(lr.records, lr.elapsed_s)
    assert (s.requests, s.ok, s.errors) == (8, 8, {})
    assert s.violations == {}
    assert all(r.finish_reason in ("stop", "length") for r in lr.records)
    assert all(0 < (r.completion_tokens or 0) <= 64 and (r.prompt_tokens or 0) > 10 for r in lr.records)
    assert all(r.cached_tokens == 0 for r in lr.records)
    assert s.req_per_s > 0 and s.output_tok_per_s > 0 and s.total_tok_per_s > s.output_tok_per_s
    assert s.ttft_ms.p50 is not None and s.e2e_ms.p50 is not None and 0 < s.ttft_ms.p50 <= s.e2e_ms.p50
    assert s.itl_ms.n > 0 and s.e2e_ms.max is not None and s.e2e_ms.max < lr.elapsed_s * 1e3
    report = build_report(result, scenario=run.scenario, config=run.config, slo=Slo(ttft_ms=10_000),
                          targets=[TargetInfo(target.label, target.description, target.model)])
    paths = write_report(report, tmp_path)
    assert {p.name for p in paths} == {"bench.json", "bench.md", "ttft.png"}
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["rows"][0]["summary"]["ok"] == 8 and len(saved["records"]) == 8
    assert saved["environment"]["versions"]["mlx-relay"] and saved["environment"]["date"]
    assert {"mlx", "mlx-lm", "mlx-vlm"} <= set(saved["environment"]["versions"])
    assert "| target | load |" in (tmp_path / "bench.md").read_text()
    assert Image.open(tmp_path / "ttft.png").format == "PNG"


async def test_our_streams_have_no_violations(server: LiveServer) -> None:
    _, result, _ = await run_short_chat(server.url)
    assert summarize(result.results[0].records, 1.0).violations == {}


def small_agent_scenario(tmp_path: Path) -> Path:
    """Agent sessions that fit the tiny model's 4k context (the shipped ones outgrow it)."""
    path = tmp_path / "small_agent.json"
    path.write_text(json.dumps({
        "name": "small_agent", "kind": "agent_session", "output": {"min": 4, "max": 12, "unit": "tokens"},
        "agent": {"system_prompt": {"min": 60, "max": 60}, "turns": {"min": 3, "max": 4},
                  "user_message": {"min": 4, "max": 10}, "tool_fraction": 0.7, "tool_result": {"min": 10, "max": 30},
                  "tools": 3},
    }))
    return path


async def test_agent_sessions_against_our_server(server: LiveServer, tmp_path: Path) -> None:
    scenario = load_scenario(str(small_agent_scenario(tmp_path)))
    jobs = build_jobs(scenario, 0, 10)
    assert any(t.tool_call for j in jobs if isinstance(j, SessionJob) for t in j.turns)
    async with HttpDriver.open(server.url) as target:
        result = await BenchRun(scenario, [target], RunConfig(levels=[Level(concurrency=2)], max_requests=10)).run()
    records = result.results[0].records
    assert len(records) == 10 and all(r.ok for r in records), [r.error_detail for r in records]
    by_session: dict[str, list[int]] = {}
    for r in sorted(records, key=lambda r: r.request_id):
        by_session.setdefault(r.request_id.split(".t")[0], []).append(r.prompt_tokens or 0)
    for prompts in by_session.values():  # every turn resends the history plus the reply
        assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)


def test_the_cli_against_our_server(server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    code = main(["bench", "--target", f"ours={server.url}", "--scenario", "short_chat", "--concurrency", "1,2",
                 "--requests", "4", "--out", str(out), "--slo-ttft-ms", "10000", "--slo-itl-ms", "1000"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert {p.name for p in out.iterdir()} == {"bench.json", "bench.md", "ttft.png", "latency_vs_throughput.png"}
    assert "| ours | c=1 | 4 / 4 | 0 |" in captured.out and "| ours | c=2 | 4 / 4 | 0 |" in captured.out
    saved = json.loads((out / "bench.json").read_text())
    assert [row["summary"]["slo_met"] for row in saved["rows"]] == [4, 4]
    assert "bench: c=2" in captured.err


async def test_the_in_process_driver(relay: Relay, tmp_path: Path) -> None:
    driver = InProcessDriver(relay)
    run = BenchRun(load_scenario("short_chat"), [driver], RunConfig(levels=[Level(concurrency=2)], max_requests=6))
    result = await run.run()
    (lr,) = result.results
    s = summarize(lr.records, lr.elapsed_s)
    assert (s.ok, s.errors, s.violations) == (6, {}, {})
    assert all(r.finish_reason in ("stop", "length") and (r.completion_tokens or 0) > 0 for r in lr.records)
    assert s.ttft_ms.p50 is not None and s.itl_ms.n > 0
    # an image request takes the vision path and is answered
    image_job = build_jobs(load_scenario("images"), 0, 1)[0]
    assert isinstance(image_job, ChatJob)
    outcome = await driver.send(image_job.request)
    assert outcome.measurement.error is None, outcome.measurement.error_detail
    assert (outcome.measurement.completion_tokens or 0) > 0
    # a session's tool turn (assistant tool_calls + a tool message) goes through the API as is
    jobs = build_jobs(load_scenario(str(small_agent_scenario(tmp_path))), 0, 10)
    session, turn = next((j, k) for j in jobs if isinstance(j, SessionJob) for k, t in enumerate(j.turns)
                         if t.tool_call)
    replies: list[str] = []
    for k in range(turn + 1):
        outcome = await driver.send(session_request(session, k, replies))
        assert outcome.measurement.error is None, outcome.measurement.error_detail
        replies.append(outcome.text)

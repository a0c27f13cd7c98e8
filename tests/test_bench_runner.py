"""The bench runner on a scripted double of an HTTP server: waves alternate between targets,
open loop arrivals, the progress line, and stopping (Ctrl-C, a cancel scope, the duration bound)
with the partial results still returned and written."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from mlx_relay.bench.client import HttpDriver
from mlx_relay.bench.double import DoubleServer
from mlx_relay.bench.errors import BenchError, TargetError
from mlx_relay.bench.metrics import Slo
from mlx_relay.bench.progress import Progress
from mlx_relay.bench.records import RequestRecord
from mlx_relay.bench.report import Report, TargetInfo, build_report, markdown, write_report
from mlx_relay.bench.runner import BenchRun, Level, RunConfig
from mlx_relay.bench.scenario import load_scenario
from mlx_relay.testing.live_server import free_port

SHORT = load_scenario("short_chat")


@pytest.fixture(scope="module")
def double() -> Iterator[DoubleServer]:
    with DoubleServer() as server:
        yield server


class StopAfter(Progress):
    """Progress that presses Ctrl-C (`run.stop()`) once `n` requests have finished."""

    def __init__(self, n: int) -> None:
        self.out = io.StringIO()
        super().__init__(self.out, tty=False)
        self.n = n
        self.run: BenchRun | None = None

    def on_record(self, record: RequestRecord) -> None:
        super().on_record(record)
        if self.done >= self.n and self.run is not None:
            self.run.stop()

    def text(self) -> str:
        return self.out.getvalue()


def report_of(run: BenchRun, drivers: list[HttpDriver]) -> Report:
    return build_report(run.result(), scenario=run.scenario, config=run.config, slo=Slo(ttft_ms=1000),
                        targets=[TargetInfo(d.label, d.description, d.model) for d in drivers])


async def test_waves_alternate_between_targets_and_ratios_are_reported(double: DoubleServer) -> None:
    async with HttpDriver.open(double.url + "/good", label="A") as a, \
            HttpDriver.open(double.url + "/good", label="B") as b:
        config = RunConfig(levels=[Level(concurrency=2)], max_requests=12, wave_requests=4)
        run = BenchRun(SHORT, [a, b], config)
        result = await run.run()
    assert result.stop_reason == "completed"
    by_target = {lr.target: sorted(lr.records, key=lambda r: r.start_s) for lr in result.results}
    assert [len(v) for v in by_target.values()] == [12, 12]
    assert [r.request_id for r in by_target["A"]][:4] == [f"short_chat-{i:05d}" for i in range(4)]
    start = {t: [r.start_s for r in recs] for t, recs in by_target.items()}
    # waves of 4: A B, then B A (ABBA), then A B; each target runs the same requests
    assert max(start["A"][:4]) < min(start["B"][:4]) and max(start["B"][4:8]) < min(start["A"][4:8])
    assert max(start["A"][4:8]) < min(start["A"][8:]) and max(start["A"][8:]) < min(start["B"][8:])
    assert sorted(r.request_id for r in by_target["A"]) == sorted(r.request_id for r in by_target["B"])
    report = report_of(run, [a, b])
    assert report.rows[0].vs_first is None and report.rows[1].vs_first is not None
    assert "| B/A | c=2 |" in markdown(report)


async def test_an_unreachable_target_fails_fast_and_a_run_runs_once(double: DoubleServer) -> None:
    async with HttpDriver.open(f"http://127.0.0.1:{free_port()}") as nobody:
        with pytest.raises(TargetError, match="cannot reach"):
            await BenchRun(SHORT, [nobody], RunConfig(max_requests=4)).run()
    async with HttpDriver.open(double.url + "/good") as target:
        run = BenchRun(SHORT, [target], RunConfig(max_requests=2))
        await run.run()
        with pytest.raises(BenchError):
            await run.run()
        with pytest.raises(BenchError, match="unique"):
            BenchRun(SHORT, [target, target])


async def test_open_loop_poisson_arrivals(double: DoubleServer) -> None:
    async with HttpDriver.open(double.url + "/good") as target:
        run = BenchRun(SHORT, [target], RunConfig(levels=[Level(rate=40.0)], max_requests=10, warmup_requests=0))
        result = await run.run()
    (lr,) = result.results
    assert result.stop_reason == "completed" and lr.level == "rate=40/s" and len(lr.records) == 10
    assert all(r.ok for r in lr.records) and lr.in_flight == 0


async def test_ctrl_c_stops_the_run_and_keeps_partial_results(double: DoubleServer, tmp_path: Path) -> None:
    progress = StopAfter(3)
    async with HttpDriver.open(double.url + "/slow") as target:
        run = BenchRun(SHORT, [target], RunConfig(levels=[Level(concurrency=2), Level(concurrency=4)],
                                                  max_requests=40), progress)
        progress.run = run
        with anyio.fail_after(20):
            result = await run.run()
    assert result.stop_reason == "interrupted"
    first, second = result.results
    assert 3 <= len(first.records) < 40 and all(r.ok for r in first.records)
    assert first.in_flight <= 2 and second.records == []
    assert "bench: c=2" in progress.text()
    paths = write_report(report_of(run, [target]), tmp_path)
    assert {p.name for p in paths} == {"bench.json", "bench.md", "ttft.png", "latency_vs_throughput.png"}
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["stop_reason"] == "interrupted" and len(saved["records"]) == len(first.records)
    assert "stopped: interrupted" in (tmp_path / "bench.md").read_text()


async def test_an_enclosing_cancel_scope_and_the_duration_bound(double: DoubleServer) -> None:
    async with HttpDriver.open(double.url + "/slow") as target:
        run = BenchRun(SHORT, [target], RunConfig(levels=[Level(concurrency=2)], max_requests=40))
        with anyio.move_on_after(1.0) as scope:
            await run.run()
        assert scope.cancelled_caught
        partial = run.result()
        # what finished before the cancel is kept (how much depends on the machine's speed: not asserted)
        assert partial.stop_reason == "interrupted" and len(partial.results[0].records) < 40
        bounded = BenchRun(SHORT, [target], RunConfig(levels=[Level(concurrency=2)], max_requests=40,
                                                      max_duration_s=1.0))
        with anyio.fail_after(20):
            result = await bounded.run()  # stops by itself, returns normally
    assert result.stop_reason == "max_duration" and len(result.results[0].records) < 40


def test_the_progress_line() -> None:
    now = [0.0]
    tty_out, plain_out = io.StringIO(), io.StringIO()
    tty = Progress(tty_out, tty=True, clock=lambda: now[0])
    tty.begin("c=4", 8)
    record = RequestRecord(request_id="r", scenario="s", target="A", level="c=4", start_s=0.0, completion_tokens=10)
    now[0] = 2.0
    tty.on_record(record)
    tty.on_record(RequestRecord(request_id="r", scenario="s", target="A", level="c=4", start_s=0.0, error="timeout"))
    out = tty_out.getvalue()
    assert out.startswith("\r") and out.count("\r") == 2 and "\n" not in out
    assert "2/8 req · 1 err · 1.00 req/s · 5.0 tok/s" in out
    plain = Progress(plain_out, tty=False, every_s=5.0, clock=lambda: now[0])
    plain.begin("c=1", 3)
    for _ in range(3):
        plain.on_record(record)  # one line at the first record, then not again within 5 s
    plain.end()
    lines = plain_out.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("bench: c=1") and "3/3 req" in lines[-1]


def test_the_cli_writes_partial_results_on_sigint(double: DoubleServer, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_relay.cli", "bench", "--target", double.url + "/slow", "--concurrency", "2",
         "--requests", "100", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # the first progress line: requests are finishing
    assert line.startswith("bench: c=2"), line
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted; writing the partial results" in stderr
    saved = json.loads((out / "bench.json").read_text())
    assert saved["stop_reason"] == "interrupted" and 0 < len(saved["records"]) < 100
    assert "| target | load |" in stdout and (out / "ttft.png").exists()

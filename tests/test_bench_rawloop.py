"""The raw-library-loop driver: the same scenario requests, straight into mlx-vlm's BatchGenerator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio

from mlx_relay.bench.metrics import summarize
from mlx_relay.bench.rawloop import RawLoopDriver
from mlx_relay.bench.runner import BenchRun, Level, RunConfig
from mlx_relay.bench.scenario import load_scenario
from mlx_relay.bench.workload import ChatJob, build_jobs


async def test_raw_loop_serves_a_scenario_and_matches_the_reference(fp32_model: Path) -> None:
    async with RawLoopDriver.open(fp32_model, max_num_seqs=4) as driver:
        run = BenchRun(load_scenario("short_chat"), [driver], RunConfig(levels=[Level(concurrency=3)], max_requests=6))
        result = await run.run()
        (lr,) = result.results
        s = summarize(lr.records, lr.elapsed_s)
        assert (s.ok, s.errors, s.violations) == (6, {}, {})
        assert all((r.completion_tokens or 0) == len(r.itl_s) + 1 for r in lr.records)  # one time per token
        assert s.ttft_ms.p50 is not None and s.itl_ms.n > 0
        # greedy and batched, it still returns what the plain single-sequence loop returns
        job = build_jobs(load_scenario("short_chat"), 0, 1)[0]
        assert isinstance(job, ChatJob)
        ids = driver._render(job.request)
        outcome = await driver.send(job.request)
    ref = await anyio.run_process(
        [sys.executable, "-m", "mlx_relay.testing.reference", str(fp32_model), str(job.request.max_tokens)],
        input=json.dumps([ids]).encode(),
    )
    expected = json.loads(ref.stdout)[0]
    assert outcome.measurement.completion_tokens == len(expected)
    assert outcome.text == driver._tokenizer.decode(expected, skip_special_tokens=True)

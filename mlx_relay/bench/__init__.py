"""mlx-relay bench: a load-test harness for OpenAI-compatible servers and the in-process engine.

    from mlx_relay.bench.api import BenchRun, HttpDriver, Level, RunConfig, Slo, load_scenario, ...

    async with HttpDriver.open("http://127.0.0.1:8000") as target:
        run = BenchRun(load_scenario("short_chat"), [target], RunConfig(levels=[Level(concurrency=4)]))
        result = await run.run()
    report = build_report(result, scenario=..., config=..., slo=Slo(ttft_ms=500), targets=[...])
    write_report(report, Path("out"))

Modules: `scenario` (scenarios as JSON data), `workload`/`session` (requests from a seed),
`client`/`inprocess` (the drivers), `sse_check` (stream checks), `runner` (closed/open loop,
waves across targets, bounds, cancellation), `metrics` (pure aggregates), `report`/`plots`
(JSON, markdown, PNG), `safety` (loopback-only targets), `cli` (`mlx-relay bench`); `api`
gathers the public names. This package's own import stays empty, so `mlx-relay serve` does not
pay for (or need) the harness's dependencies (httpx, matplotlib).
"""

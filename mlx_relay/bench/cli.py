"""`mlx-relay bench`: the argument wiring of the load-test harness (mlx_relay.cli calls in here).

    mlx-relay bench --target http://127.0.0.1:8000 --scenario short_chat --concurrency 1,4,16
    mlx-relay bench --target ours=http://127.0.0.1:8000 --target lm=http://127.0.0.1:8080 --rate 2
    mlx-relay bench --in-process [MODEL] --scenario agent_sessions --requests 60

Targets are checked (loopback unless `--allow-host HOST`) before anything is sent. Ctrl-C stops
the run and still writes the partial results (exit status 130). Heavy imports wait until a run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_relay.bench.driver import Driver
    from mlx_relay.bench.progress import Progress
    from mlx_relay.bench.report import TargetInfo
    from mlx_relay.bench.runner import BenchResult, BenchRun, Level, RunConfig
    from mlx_relay.bench.scenario import Scenario

EMBEDDED = ""  # --in-process without a MODEL: the embedded tiny model


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `bench` on the subparsers of the `mlx-relay` parser."""
    p = sub.add_parser(
        "bench",
        help="load-test OpenAI-compatible servers or the in-process engine",
        description="Load-test one or more OpenAI-compatible servers (streamed /v1/chat/completions), or the "
                    "in-process engine, with a scenario; writes JSON, a markdown table and PNG plots.",
        epilog="Scenarios: short_chat, long_prompt, agent_sessions, images, mix (benchmarks/scenarios/*.json), "
               "or a path to a scenario JSON file. Targets must be loopback unless named with --allow-host.",
    )
    where = p.add_argument_group("targets (at least one)")
    where.add_argument("--target", action="append", default=[], metavar="[NAME=]URL",
                       help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeatable: several targets "
                            "are driven in alternating waves and compared, ratios to the first)")
    where.add_argument("--in-process", nargs="?", const=EMBEDDED, default=None, metavar="MODEL",
                       help="drive the engine in this process, no HTTP (default MODEL: the embedded tiny model)")
    where.add_argument("--raw-loop", default=None, metavar="MODEL",
                       help="the floor: the same requests straight into mlx-vlm's BatchGenerator in this process "
                            "(no server, no HTTP)")
    where.add_argument("--allow-host", action="append", default=[], metavar="HOST",
                       help="allow this non-loopback host as a target (repeatable)")
    where.add_argument("--model", default=None, help="the model name to send (default: the target's first model)")
    where.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    what = p.add_argument_group("workload")
    what.add_argument("--scenario", default="short_chat", metavar="NAME_OR_PATH",
                      help="a shipped scenario name or a scenario JSON file (default short_chat)")
    what.add_argument("--list-scenarios", action="store_true", help="list the shipped scenarios and exit")
    what.add_argument("--seed", type=int, default=None, help="request generation seed (default: the scenario's)")
    load = p.add_argument_group("load (closed loop by default)")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", default=None, metavar="N[,N...]",
                      help="closed loop with N requests in flight; a list sweeps (default 1)")
    mode.add_argument("--rate", default=None, metavar="R[,R...]",
                      help="open loop: Poisson arrivals at R requests (sessions) a second; a list sweeps")
    load.add_argument("--requests", type=int, default=None,
                      help="requests per load level and target (default: the scenario's, at most 200)")
    load.add_argument("--duration", type=float, default=300.0, help="stop the whole run after S seconds (default 300)")
    load.add_argument("--wave", type=int, default=None,
                      help="with several targets: requests per wave (default 4 x concurrency, at least 8)")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests per target first (default 1)")
    load.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds (default 300)")
    slo = p.add_argument_group("objectives (goodput: requests per second meeting all of them)")
    slo.add_argument("--slo-ttft-ms", type=float, default=None, help="time to first token")
    slo.add_argument("--slo-itl-ms", type=float, default=None, help="mean inter-token latency of a request")
    slo.add_argument("--slo-e2e-ms", type=float, default=None, help="end-to-end latency")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None,
                     help="output directory (default bench-results/SCENARIO-DATE)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def parse_list(text: str, kind: type[int] | type[float], flag: str) -> list[Any]:
    from mlx_relay.bench.errors import BenchError

    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"{flag}: expected a comma-separated list of numbers, got {text!r}") from None
    if not values:
        raise BenchError(f"{flag}: no value given")
    return values


def parse_levels(concurrency: str | None, rate: str | None) -> list[Level]:
    from mlx_relay.bench.runner import Level

    if rate is not None:
        return [Level(rate=r) for r in parse_list(rate, float, "--rate")]
    return [Level(concurrency=c) for c in parse_list(concurrency or "1", int, "--concurrency")]


def parse_targets(specs: list[str]) -> list[tuple[str | None, str]]:
    """`[NAME=]URL` -> (NAME or None, URL)."""
    out: list[tuple[str | None, str]] = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if sep and "://" not in name:
            out.append((name, url))
        else:
            out.append((None, spec))
    return out


def _unique_labels(drivers: list[Driver]) -> None:
    seen: dict[str, int] = {}
    for d in drivers:
        n = seen.get(d.label, 0) + 1
        seen[d.label] = n
        if n > 1:
            d.label = f"{d.label}#{n}"


async def _stop_on_signal(run: BenchRun, err: Any) -> None:
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            print("\nmlx-relay bench: interrupted; writing the partial results", file=err, flush=True)
            run.stop()


async def _run(args: argparse.Namespace, scenario: Scenario, config: RunConfig,
               progress: Progress) -> tuple[BenchResult, list[TargetInfo]]:
    import anyio

    from mlx_relay.bench.client import HttpDriver
    from mlx_relay.bench.inprocess import InProcessDriver
    from mlx_relay.bench.report import TargetInfo
    from mlx_relay.bench.runner import BenchRun

    async with AsyncExitStack() as stack:
        drivers: list[Driver] = []
        if args.in_process is not None:
            from mlx_relay.relay import Relay

            relay = await stack.enter_async_context(Relay.start(args.in_process or None))
            drivers.append(InProcessDriver(relay, timeout_s=args.timeout))
        if args.raw_loop is not None:
            from pathlib import Path as _Path

            from mlx_relay.bench.rawloop import RawLoopDriver

            max_seqs = max([lvl.concurrency or 0 for lvl in config.levels] + [1])
            drivers.append(await stack.enter_async_context(RawLoopDriver.open(_Path(args.raw_loop),
                                                                              max_num_seqs=max_seqs)))
        max_conn = max([lvl.concurrency or 0 for lvl in config.levels] + [64]) + 8
        for name, url in parse_targets(args.target):
            drivers.append(await stack.enter_async_context(HttpDriver.open(
                url, label=name, model=args.model, api_key=args.api_key, timeout_s=args.timeout,
                max_connections=max_conn, allow_hosts=args.allow_host)))
        _unique_labels(drivers)
        run = BenchRun(scenario, drivers, config, progress)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, run, progress.stream)
            result = await run.run()
            tg.cancel_scope.cancel()
        return result, [TargetInfo(d.label, d.description, d.model) for d in drivers]


def run_from_args(args: argparse.Namespace) -> int:
    import anyio

    from mlx_relay.bench.errors import BenchError
    from mlx_relay.bench.metrics import Slo
    from mlx_relay.bench.progress import Progress
    from mlx_relay.bench.report import build_report, markdown, write_report
    from mlx_relay.bench.runner import RunConfig
    from mlx_relay.bench.safety import check_target
    from mlx_relay.bench.scenario import load_scenario, shipped_names

    if args.list_scenarios:
        print("\n".join(shipped_names()))
        return 0
    try:
        if not args.target and args.in_process is None and args.raw_loop is None:
            raise BenchError("give at least one --target URL, --in-process [MODEL] or --raw-loop MODEL")
        for _, url in parse_targets(args.target):  # before anything is sent anywhere
            check_target(url, args.allow_host)
        scenario = load_scenario(args.scenario)
        requests = args.requests if args.requests is not None else min(scenario.requests, 200)
        if requests < 1 or args.duration <= 0 or args.timeout <= 0:
            raise BenchError("--requests, --duration and --timeout must be positive")
        config = RunConfig(levels=parse_levels(args.concurrency, args.rate), max_requests=requests,
                           max_duration_s=args.duration, seed=args.seed, wave_requests=args.wave,
                           warmup_requests=max(0, args.warmup))
        slo = Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, e2e_ms=args.slo_e2e_ms)
        if any(m and os.path.isdir(m) for m in (args.in_process, args.raw_loop)):
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint needs nothing from the Hub
        progress = Progress(sys.stderr)
        try:
            result, targets = anyio.run(_run, args, scenario, config, progress)
        except KeyboardInterrupt:  # before the run started (e.g. while the in-process model loaded)
            print("\nmlx-relay bench: interrupted before the run started", file=sys.stderr)
            return 130
    except BenchError as exc:
        print(f"mlx-relay bench: error: {exc}", file=sys.stderr)
        return 1
    report = build_report(result, scenario=scenario, config=config, slo=slo, targets=targets)
    out_dir = args.out or Path("bench-results") / f"{scenario.name}-{datetime.now():%Y%m%d-%H%M%S}"
    paths = write_report(report, out_dir, plots=not args.no_plots)
    print(markdown(report))
    print("mlx-relay bench: wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 130 if result.stop_reason == "interrupted" else 0

"""The report of a run: one JSON document (everything, each request included), a markdown table
and PNG plots, written side by side into one output directory.

`build_report` summarizes each (target, load level) with `metrics.summarize` and, with several
targets, the ratio of each target to the first (B/A) for every compared metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from mlx_relay.bench.machine import Environment, environment
from mlx_relay.bench.metrics import Slo, Summary, metric, ratios, summarize
from mlx_relay.bench.records import RequestRecord
from mlx_relay.bench.runner import BenchResult, RunConfig, StopReason
from mlx_relay.bench.scenario import Scenario


class TargetInfo(msgspec.Struct, frozen=True):
    label: str
    description: str
    model: str | None


class Row(msgspec.Struct, kw_only=True):
    target: str
    level: str
    concurrency: int | None
    rate: float | None
    in_flight: int
    skipped: int
    summary: Summary
    error_examples: dict[str, str] = {}  # error kind -> the first request's error detail
    vs_first: dict[str, float | None] | None = None  # this target / the first target, same level


class Report(msgspec.Struct, kw_only=True):
    tool: str = "mlx-relay bench"
    environment: Environment
    scenario: Scenario
    config: RunConfig
    slo: Slo
    targets: list[TargetInfo]
    seed: int
    stop_reason: StopReason
    elapsed_s: float
    rows: list[Row]
    records: list[RequestRecord]


def build_report(result: BenchResult, *, scenario: Scenario, config: RunConfig, slo: Slo,
                 targets: Sequence[TargetInfo], env: Environment | None = None) -> Report:
    rows: list[Row] = []
    first: dict[str, Summary] = {}
    for lr in result.results:
        summary = summarize(lr.records, lr.elapsed_s, slo)
        base = first.setdefault(lr.level, summary)
        examples: dict[str, str] = {}
        for r in lr.records:
            if r.error is not None:
                examples.setdefault(r.error, r.error_detail)
        rows.append(Row(target=lr.target, level=lr.level, concurrency=lr.concurrency, rate=lr.rate,
                        in_flight=lr.in_flight, skipped=lr.skipped, summary=summary, error_examples=examples,
                        vs_first=ratios(base, summary) if base is not summary else None))
    return Report(environment=env or environment(), scenario=scenario, config=config, slo=slo,
                  targets=list(targets), seed=result.seed, stop_reason=result.stop_reason,
                  elapsed_s=result.elapsed_s, rows=rows,
                  records=[r for lr in result.results for r in lr.records])


# -- markdown --------------------------------------------------------------------------------------
def _num(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _triple(summary: Summary, name: str) -> str:
    return " / ".join(_num(metric(summary, f"{name}.{p}")) for p in ("p50", "p90", "p99"))


def _ratio_triple(r: dict[str, float | None], name: str) -> str:
    return " / ".join(_ratio(r.get(f"{name}.{p}")) for p in ("p50", "p90", "p99"))


def _kinds(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} ×{n}" for k, n in counts.items())


def markdown_table(report: Report) -> str:
    header = ("| target | load | ok / measured | errors | violations | req/s | out tok/s | goodput req/s "
              "| TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | e2e p50 / p90 / p99 ms |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    first_label = report.targets[0].label if report.targets else ""
    for row in report.rows:
        s = row.summary
        lines.append(
            f"| {row.target} | {row.level} | {s.ok} / {s.requests} | {s.requests - s.ok} "
            f"| {sum(s.violations.values())} | {_num(s.req_per_s)} | {_num(s.output_tok_per_s)} "
            f"| {_num(s.goodput_req_per_s)} | {_triple(s, 'ttft_ms')} | {_triple(s, 'itl_ms')} "
            f"| {_triple(s, 'e2e_ms')} |"
        )
        if row.vs_first is not None:
            r = row.vs_first
            lines.append(
                f"| {row.target}/{first_label} | {row.level} | | | | {_ratio(r.get('req_per_s'))} "
                f"| {_ratio(r.get('output_tok_per_s'))} | {_ratio(r.get('goodput_req_per_s'))} "
                f"| {_ratio_triple(r, 'ttft_ms')} | {_ratio_triple(r, 'itl_ms')} | {_ratio_triple(r, 'e2e_ms')} |"
            )
    return "\n".join(lines)


def markdown(report: Report) -> str:
    env = report.environment
    m = env.machine
    versions = ", ".join(f"{k} {v}" for k, v in env.versions.items() if k.startswith("mlx") and v)
    cfg = report.config
    slo = [f"{name} ≤ {value:g} ms" for name, value in
           (("TTFT", report.slo.ttft_ms), ("mean ITL", report.slo.itl_ms), ("e2e", report.slo.e2e_ms))
           if value is not None]
    out = [
        f"# mlx-relay bench: {report.scenario.name}",
        "",
        f"{env.date} · {m.system} {m.machine}, {m.processor or 'cpu'} × {m.cpu_count}, "
        f"{m.memory_gb} GiB · {versions}",
        "",
        "Targets: " + "; ".join(f"**{t.label}** {t.description}" + (f" (model `{t.model}`)" if t.model else "")
                                for t in report.targets),
        "",
        f"Scenario `{report.scenario.name}` ({report.scenario.kind}), seed {report.seed}, "
        f"up to {cfg.max_requests} requests per load level and target; "
        f"{'stopped: ' + report.stop_reason if report.stop_reason != 'completed' else 'completed'} "
        f"after {report.elapsed_s:.1f} s. Objectives: {', '.join(slo) if slo else 'none (no goodput)'}.",
        "",
        markdown_table(report),
    ]
    if len(report.targets) > 1:
        out += ["", f"Ratios are each target over **{report.targets[0].label}** at the same load; "
                    "waves alternate between targets (ABBA) so machine drift cancels."]
    notes = []
    for row in report.rows:
        s = row.summary
        where = f"- {row.target} {row.level}:"
        for kind, n in s.errors.items():
            example = " ".join(row.error_examples.get(kind, "").split())[:160]
            notes.append(f"{where} error {kind} ×{n}" + (f" (first: {example})" if example else ""))
        if s.violations:
            notes.append(f"{where} stream violations {_kinds(s.violations)}")
        if row.in_flight:
            notes.append(f"{where} {row.in_flight} requests in flight when the run stopped (not measured)")
        if row.skipped:
            notes.append(f"{where} {row.skipped} session turns not sent after a failed turn")
    if notes:
        out += ["", *notes]
    return "\n".join(out) + "\n"


def write_report(report: Report, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write bench.json, bench.md and the plots into `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "bench.json", out_dir / "bench.md"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(report), indent=1) + b"\n")
    md_path.write_text(markdown(report), encoding="utf-8")
    written = [json_path, md_path]
    if plots:
        from mlx_relay.bench.plots import write_plots

        written += write_plots(report, out_dir)
    return written

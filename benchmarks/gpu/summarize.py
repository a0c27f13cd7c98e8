"""Merge the per-server bench reports of one GPU lease into one comparison per scenario.

When the GPU runner serves one server at a time, or runs the raw loop after the servers, each run
is its own `bench.json` (an alternating run holds both servers already). This merges them by scenario:
rows ordered by load level, ratios against a base target (default `ours`), the harness's own
markdown table and plots (`mlx_relay.bench.report` / `plots`).

    python benchmarks/gpu/summarize.py RESULTS_DIR [--base ours]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import msgspec

from mlx_relay.bench.metrics import ratios
from mlx_relay.bench.plots import write_plots
from mlx_relay.bench.report import Report, markdown_table


def merge(reports: list[Report], base: str) -> Report:
    rows = sorted((row for r in reports for row in r.rows), key=lambda row: (row.concurrency or 0, row.target != base))
    by_level = {row.level: row.summary for row in rows if row.target == base}
    for row in rows:
        b = by_level.get(row.level)
        row.vs_first = ratios(b, row.summary) if b is not None and row.target != base else None
    targets = {t.label: t for r in reports for t in r.targets}
    ordered = list(targets.values())
    if base in targets:
        ordered = [targets[base], *(t for k, t in targets.items() if k != base)]
    first = reports[0]
    return msgspec.structs.replace(first, targets=ordered, rows=rows, records=[x for r in reports for x in r.records],
                                   elapsed_s=sum(r.elapsed_s for r in reports))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path)
    parser.add_argument("--base", default="ours")
    args = parser.parse_args()
    by_scenario: dict[str, list[Report]] = defaultdict(list)
    for path in sorted(args.results.glob("*.json")):
        try:
            report = msgspec.json.decode(path.read_bytes(), type=Report)
        except msgspec.ValidationError:
            continue  # not a bench report (e.g. the raw batch loop's JSON)
        by_scenario[report.scenario.name].append(report)
    for name, reports in sorted(by_scenario.items()):
        merged = merge(reports, args.base)
        out = args.results / name
        out.mkdir(exist_ok=True)
        env = merged.environment
        md = (f"# {name}: {', '.join(t.label for t in merged.targets)}\n\n"
              f"{env.date} · {env.machine.system} {env.machine.machine}, {env.machine.cpu_count} CPUs, "
              f"{env.machine.memory_gb} GiB · " + ", ".join(f"{k} {v}" for k, v in env.versions.items()) +
              f"\n\nRatios are each target over **{args.base}** at the same load.\n\n" + markdown_table(merged) + "\n")
        (out / "summary.md").write_text(md)
        write_plots(merged, out)
        print(md)


if __name__ == "__main__":
    main()

"""PNG plots of a report (matplotlib, Agg backend: no display needed).

- `ttft.png`: the time-to-first-token distribution of each target and load level, as a
  histogram and as a CDF.
- `latency_vs_throughput.png` (sweeps only): TTFT and ITL percentiles against output token
  throughput, one line per target through its load levels.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib
import numpy as np

matplotlib.use("Agg")  # before pyplot: render to files only

import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from mlx_relay.bench.report import Report


def _ttft_series(report: Report) -> list[tuple[str, list[float]]]:
    series: dict[tuple[str, str], list[float]] = {}
    for r in report.records:
        if r.ok and r.ttft_s is not None:
            series.setdefault((r.target, r.level), []).append(r.ttft_s * 1e3)
    return [(f"{t} {lvl}", sorted(v)) for (t, lvl), v in series.items()]


def plot_ttft(report: Report, path: Path) -> Path:
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = _ttft_series(report)
    everything = [v for _, values in series for v in values] or [0.0]
    n_bins = min(40, max(5, len(everything) // (2 * max(1, len(series)))))
    bins = np.linspace(min(everything), max(everything) + 1e-9, n_bins + 1)  # shared, so the bars compare
    for label, values in series:
        hist.hist(values, bins=bins, alpha=0.5, label=label)
        cdf.plot([values[0], *values], [0.0, *((i + 1) / len(values) for i in range(len(values)))],
                 drawstyle="steps-post", label=label)
    hist.set(xlabel="time to first token (ms)", ylabel="requests", title="TTFT histogram")
    cdf.set(xlabel="time to first token (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    for ax in (hist, cdf):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.scenario.name}: time to first token")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_vs_throughput(report: Report, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for target in dict.fromkeys(row.target for row in report.rows):
        rows = [row for row in report.rows if row.target == target and row.summary.ok]
        x = [row.summary.output_tok_per_s for row in rows]
        for ax, name in zip(axes, ("ttft_ms", "itl_ms"), strict=True):
            for pct, style in (("p50", "-o"), ("p99", "--x")):
                y = [getattr(getattr(row.summary, name), pct) for row in rows]
                pts = [(a, b, row.level) for a, b, row in zip(x, y, rows, strict=True) if b is not None]
                if not pts:
                    continue
                line = ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{target} {pct}")[0]
                if pct == "p50":
                    for a, b, level in pts:
                        ax.annotate(level, (a, b), textcoords="offset points", xytext=(4, 4), fontsize=7,
                                    color=line.get_color())
    axes[0].set(xlabel="output tokens / s", ylabel="ms", title="time to first token vs throughput")
    axes[1].set(xlabel="output tokens / s", ylabel="ms", title="inter-token latency vs throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"{report.scenario.name}: latency against throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(report: Report, out_dir: Path) -> list[Path]:
    paths = [plot_ttft(report, out_dir / "ttft.png")]
    if len({row.level for row in report.rows}) > 1:
        paths.append(plot_latency_vs_throughput(report, out_dir / "latency_vs_throughput.png"))
    return paths

"""One TTFT table from several `bench_specprefill.py` runs of the same target, one per draft
(device_specprefill.sh, DRAFT_KIND=both: DIR/hybrid and DIR/dense): per prompt length, the
`off` row (no SpecPrefill, every token prefilled; the median over the runs' own `off` rows) and
one row per draft and keep fraction, with its TTFT, speedup over its own run's `off`, the
draft's scoring time and the library that ran the draft.

    python benchmarks/gpu/specprefill_compare.py DIR [--out DIR/specprefill-compare.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from mlx_relay.bench.tables import rows_markdown


def compare(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the merged table from each draft's specprefill.json body, by draft name."""
    by_length: dict[int, list[dict[str, Any]]] = {}
    for name, body in runs.items():
        library = (body["meta"].get("draft_info") or {}).get("library", "")
        for row in body["rows"]:
            by_length.setdefault(int(row["length"]), []).append({**row, "draft": name, "library": library})
    rows: list[dict[str, Any]] = []
    for length in sorted(by_length):
        cells = by_length[length]
        offs = [c["ttft_ms"] for c in cells if c["mode"] == "off"]
        rows.append({"length": length, "draft": "(none)", "mode": "off", "ttft_ms": round(statistics.median(offs), 1),
                     "speedup": 1.0, "scoring_ms": "", "kept": "", "library": "", "off_runs_ms": "/".join(
                         f"{v:.0f}" for v in offs)})
        for c in cells:
            if c["mode"] != "off":
                rows.append({"length": length, "draft": c["draft"], "mode": c["mode"], "ttft_ms": c["ttft_ms"],
                             "speedup": c["speedup"], "scoring_ms": c["scoring_ms"],
                             "kept": f"{c['kept']}/{c['scored']}" if c["scored"] != "" else "",
                             "library": c["library"], "off_runs_ms": ""})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="holds one subdirectory per draft, each with specprefill.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(args.dir.glob("*/specprefill.json"))}
    if not runs:
        raise SystemExit(f"no */specprefill.json under {args.dir}")
    table = rows_markdown(compare(runs))
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()

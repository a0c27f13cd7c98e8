"""Markdown tables of benchmark rows (shared by the scripts under benchmarks/)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def rows_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """One column per key (in first-seen order), one line per row; a missing value is blank."""
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(c for r in rows for c in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)

"""docs/agents.md's "Where they stand" is generated from the `make agents` runs on record
(`benchmarks/agents/standing.py`; issue 44.1: no hand-written claim about which agents pass): the
block between its markers is the script's output, so a run recorded without it, or an edit by
hand, fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _standing() -> object:
    spec = importlib.util.spec_from_file_location("standing", ROOT / "benchmarks" / "agents" / "standing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["standing"] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def test_the_agents_standing_is_the_generated_table() -> None:
    standing = _standing()
    doc = (ROOT / "docs" / "agents.md").read_text()
    start, end = doc.index(standing.BEGIN), doc.index(standing.END) + len(standing.END)  # type: ignore[attr-defined]
    assert doc[start:end] == standing.table()  # type: ignore[attr-defined]


def test_every_agent_on_record_is_in_it_with_its_last_run() -> None:
    standing = _standing()
    found = standing.runs()  # type: ignore[attr-defined]
    text = standing.table()  # type: ignore[attr-defined]
    assert {"claude-code", "codex"} <= set(found)
    for agent, runs in found.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {agent} |"))
        assert runs[-1].when in row and ("| ok |" in row) == bool(runs[-1].entry.get("ok"))

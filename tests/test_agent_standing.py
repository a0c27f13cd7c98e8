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
    assert {("claude-code", "stock"), ("codex", "stock")} <= set(found)
    for (agent, task), runs in found.items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {agent} | {task} |"))
        last = runs[-1]
        assert last.when in row and f"| {last.server} | {last.model} |" in row


def test_the_readme_holds_the_brief_table_with_both_verdicts() -> None:
    standing = _standing()
    readme = (ROOT / "README.md").read_text()
    start = readme.index(standing.BRIEF_BEGIN)  # type: ignore[attr-defined]
    end = readme.index(standing.BRIEF_END) + len(standing.BRIEF_END)  # type: ignore[attr-defined]
    assert readme[start:end] == standing.brief()  # type: ignore[attr-defined]
    for agent, _ in standing.runs():  # type: ignore[attr-defined]
        assert f"| {agent} | " in readme[start:end]


def test_the_verdicts_split_what_the_server_owes_from_what_the_model_did() -> None:
    """A turn the toy model cannot finish is the server's 'held', not a pass; a server problem is a FAIL
    whatever the model did (`checks.Verdict`)."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "agents"))
    from checks import Verdict

    looped = Verdict("codex", "responses", None, requests=12, statuses=[200] * 12)
    assert looped.server_ok and looped.server.startswith("held;") and looped.model == "no call"
    assert not looped.ok
    gave_up = Verdict("claude-code", "messages", 1, requests=8, statuses=[200] * 8, tool_called=["x"])
    assert gave_up.server_ok and gave_up.server.startswith("held;") and gave_up.model == "called, no result back"
    broken = Verdict("cline", "chat", 0, requests=2, statuses=[200, 500], problems=["002 /v1/chat: HTTP 500"],
                     tool_called=["x"], tool_result_sent=True)
    assert broken.server.startswith("FAIL") and not broken.ok and broken.model == "round trip"
    good = Verdict("opencode", "chat", 0, requests=3, statuses=[200] * 3, tool_called=["x"], tool_result_sent=True)
    assert good.ok and good.server == "ok" and good.model == "round trip"

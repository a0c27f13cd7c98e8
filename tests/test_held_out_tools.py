"""The held-out tools of `make agents` and `benchmarks/agents/held_out.py` (issue 44.1/44.2) are
apart from what the embedded model was trained on: no word of their vocabulary is one of the
curriculum's (`tools/agent_curriculum.py`) or appears in a recorded request the agent scenes
train on; the scene's MCP server serves the tool the draw names; the rate's requests carry the
held-out tool in place of the trained one, in every agent's request."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "agents"))
sys.path.insert(0, str(ROOT / "tools"))

import held_out_tools as h  # noqa: E402

VOCABULARY = (*h.SERVERS, *h.VERBS, *h.OBJECTS, *h.PARAMS)


def _trained_requests() -> list[str]:
    from agent_scenes import SCENES

    files = {ROOT / s.file for s in SCENES}
    files |= set((ROOT / "tests" / "agent_requests").rglob("*.json"))
    return [p.read_text().lower() for p in sorted(files)]


def test_no_held_out_word_is_the_curriculums() -> None:
    import agent_curriculum as c

    trained = {*c._VERBS, *c._OBJECTS, *c._PARAMS, *c._WORDS, *(w.lower() for w in (*c._NAMES, *c._CITIES))}
    trained |= {w for enum in c._ENUMS for w in enum}
    trained |= {"stock", "path", "get"}  # the trained MCP tool's
    assert not set(VOCABULARY) & trained


def test_no_held_out_word_appears_in_a_recorded_request_the_scenes_train_on() -> None:
    texts = _trained_requests()
    assert len(texts) >= 10
    found = {w: sum(bool(re.search(rf"\b{re.escape(w)}", t)) for t in texts) for w in VOCABULARY}
    assert not {w: n for w, n in found.items() if n}


def test_draws_are_seeded_and_spread() -> None:
    assert h.draw((0, 1, 2)) == h.draw((0, 1, 2))
    tools = {h.draw((0, 0, 1, i)).tool for i in range(20)}
    assert len(tools) >= 10
    t = h.draw((3, 4))
    assert str(t.n) in t.sentence and t.valid({t.param: 7}) and t.exact({t.param: t.n})
    assert not t.valid({t.param: "7"}) and not t.valid({t.param: 7, "x": 1}) and not t.valid("{")


def test_the_scene_server_serves_the_drawn_tool() -> None:
    tree = ast.parse((ROOT / "benchmarks" / "agents" / "mcp_held_out.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    tool = h.scene_tool()
    assert fn.name == tool.tool
    assert [a.arg for a in fn.args.args] == [tool.param]
    assert ast.unparse(fn.args.args[0].annotation) == "int"


@pytest.mark.parametrize("agent", ["claude-code", "codex", "opencode", "cline", "qwen-code-slim", "qwen-code"])
def test_every_agent_request_carries_the_held_out_tool_and_no_trained_one(agent: str) -> None:
    import held_out
    from agent_scenes import body_of

    (scene,) = held_out.call_scenes([agent])
    _, body = body_of(ROOT / scene.file)
    t = h.draw((0, 9, 1, 0))
    text = json.dumps(held_out.substitute(json.dumps(body), t))
    assert "stock" not in text.lower() and t.sentence in text
    assert f"{t.server}" in text and t.tool in text
    if scene.via == "":  # declared up front: its schema names the held-out parameter
        assert json.dumps(t.schema) in text

"""The embedded model's agent skill on tools it never saw (issue 44.2): inside each coding agent's
own recorded request, the trained MCP tool (`get_stock(path)` of the server `stock`) is replaced
by a held-out one (`held_out_tools.draw`: server, name, description, schema and the user's
sentence from a vocabulary apart from the training data's), sent through `mlx-relay serve`
(greedy, not streamed, at most `--max-tokens`), and the reply judged: did the model call the
declared tool (for Claude Code, whose MCP tools are deferred, and Qwen Code's default setup, the
first step is the search tool selecting it: `ToolSearch` / `tool_search` with `select:<name>`)
with arguments valid for its schema, and with the value asked for. Beside it, the same count of
requests with the trained tool (the phrasings and paths of `tools/agent_scenes.py` drawn), so the
held-out rate reads against the trained one.

Each agent's request is the first `call` scene of `tools/agent_scenes.SCENES` (the recordings
under `tests/agent_requests/` and `benchmarks/agents/scenes/`), so what the model sees is what
that agent sends, but for the tool. Writes `benchmarks/results/held-out-<date>-<commit>/`
(summary.json with every request's verdict and reply, summary.md).

    .venv/bin/python benchmarks/agents/held_out.py [--n 20] [--trained 10] [--agents claude-code,codex]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tools"))

from agent_scenes import HARNESS_PROMPT, PHRASINGS, SCENES, Scene, body_of  # noqa: E402
from held_out_tools import HeldOutTool, as_object, draw  # noqa: E402
from run_agents import wait_ready  # noqa: E402

TRAINED = HeldOutTool("stock", "get", "stock", "path", "Get a stock.", HARNESS_PROMPT, 423)


def call_scenes(agents: list[str] | None) -> list[Scene]:
    """Each agent's first `call` scene (its first request that should call the stock tool)."""
    out: dict[str, Scene] = {}
    for s in SCENES:
        if s.target == "call" and s.agent not in out and (not agents or s.agent in agents):
            out[s.agent] = s
    return list(out.values())


def substitute(text: str, t: HeldOutTool) -> dict[str, Any]:
    """A recorded body (JSON text) with the stock tool and the harness's sentence replaced by `t`'s."""
    full = f"mcp__{t.server}__{t.tool}"
    for old, new in ((HARNESS_PROMPT, t.sentence), ("mcp__stock__get_stock", full),
                     ("stock__get_stock", f"{t.server}__{t.tool}"), ("stock_get_stock", f"{t.server}_{t.tool}"),
                     ("mcp__stock", f"mcp__{t.server}"), ("get_stockArguments", f"{t.tool}Arguments"),
                     ('"get_stock"', f'"{t.tool}"'), ("Get a stock.", t.description)):
        text = text.replace(old, new)
    text = text.replace("#### stock\\n", f"#### {t.server}\\n")  # Qwen Code's list of MCP servers
    body = json.loads(text)
    names = {full, f"{t.server}__{t.tool}", f"{t.server}_{t.tool}", t.tool}

    def fix(node: Any) -> None:  # the tool's schema: its parameter renamed
        if isinstance(node, dict):
            fn = node.get("function") if isinstance(node.get("function"), dict) else node
            if isinstance(fn.get("name"), str) and fn["name"] in names:
                key = "parameters" if "parameters" in fn else "input_schema" if "input_schema" in fn else None
                if key:
                    fn[key] = t.schema
            for v in node.values():
                fix(v)
        elif isinstance(node, list):
            for v in node:
                fix(v)

    fix(body)
    return body


def trained_body(text: str, key: tuple[int, ...]) -> tuple[dict[str, Any], HeldOutTool]:
    """The recorded body with the trained tool kept and a drawn sentence and path (as training drew them)."""
    rng = random.Random(",".join(str(k) for k in key))
    n = rng.randrange(1, 1000)
    sentence = rng.choice(PHRASINGS).format(n=n)
    text = text.replace(HARNESS_PROMPT, sentence)
    text = re.sub(r'(path\\*":\s?)423\b', lambda m: f"{m.group(1)}{n}", text)
    return json.loads(text), HeldOutTool("stock", "get", "stock", "path", "Get a stock.", sentence, n)


def jobs(scene: Scene, a: int, seed: int, trained: int, n: int) -> list[tuple[str, dict[str, Any], HeldOutTool]]:
    """The requests of the `a`-th agent's scene: `trained` with the trained tool, then `n` held-out
    ones, each (kind, body, its tool), drawn from (seed, a, kind, i)."""
    _, body = body_of(ROOT / scene.file)
    text = json.dumps(body)
    out: list[tuple[str, dict[str, Any], HeldOutTool]] = []
    for i in range(trained):
        tb, tt = trained_body(text, (seed, a, 0, i))
        out.append(("trained", tb, tt))
    for i in range(n):
        t = draw((seed, a, 1, i))
        out.append(("held-out", substitute(text, t), t))
    return out


def rejudge(path: Path) -> str:
    """A run's summary.json judged again by this file's rules from the calls it recorded (the requests
    redrawn from its seed), both summary files rewritten; the table."""
    summary = json.loads(path.read_text())
    scenes = call_scenes(list(summary["per_agent"]))
    args = argparse.Namespace(max_tokens=summary["max_tokens"], seed=summary["seed"])
    recorded = summary["verdicts"]
    verdicts: list[Verdict] = []
    for a, scene in enumerate(scenes):
        mine = [v for v in recorded if v["agent"] == scene.agent]
        counts = {k: sum(v["kind"] == k for v in mine) for k in ("trained", "held-out")}
        for (kind, _, t), v in zip(jobs(scene, a, args.seed, counts["trained"], counts["held-out"]), mine, strict=True):
            assert v["kind"] == kind and v["sentence"] == t.sentence, (v["sentence"], t.sentence)
            verdicts.append(judge(scene.agent, kind, scene, t, v["status"], [tuple(c) for c in v["calls"]], v["text"]))
    return write_summary(path.parent, summary["commit"], args, scenes, verdicts)


def prepared(route: str, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Not streamed, greedy, at most `max_tokens` (the agents ask for up to 32,000)."""
    body = dict(body, stream=False, temperature=0)
    body.pop("stream_options", None)
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        body.pop(key, None)
    body["max_output_tokens" if "/responses" in route else "max_tokens"] = max_tokens
    return body


def calls_of(route: str, reply: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of every tool call in a reply."""
    if "/messages" in route:
        return [(b.get("name", ""), b.get("input")) for b in reply.get("content") or [] if b.get("type") == "tool_use"]
    if "/responses" in route:
        return [(i.get("name", ""), i.get("arguments")) for i in reply.get("output") or []
                if i.get("type") == "function_call"]
    msg = ((reply.get("choices") or [{}])[0]).get("message") or {}
    return [((c.get("function") or {}).get("name", ""), (c.get("function") or {}).get("arguments"))
            for c in msg.get("tool_calls") or []]


@dataclass
class Verdict:
    agent: str
    kind: str  # held-out | trained
    tool: str  # the name the agent declares it under
    sentence: str
    status: int
    calls: list[tuple[str, Any]]
    right_tool: bool  # called it (or, deferred, selected it with the search tool)
    valid: bool  # ... with arguments valid for its schema (the search tool's query naming it)
    exact: bool  # ... and the value asked for (deferred: the selection is the whole step)
    text: str  # the reply's text and reasoning, cut


def judge(agent: str, kind: str, scene: Scene, t: HeldOutTool, status: int, calls: list[tuple[str, Any]], text: str
          ) -> Verdict:
    """A reply's verdict from its tool calls (`calls_of`)."""
    declared = {"codex": t.tool, "opencode": f"{t.server}_{t.tool}", "cline": f"{t.server}__{t.tool}"}.get(
        agent, f"mcp__{t.server}__{t.tool}")
    right = valid = exact = False
    if scene.via in ("ToolSearch", "tool_search"):
        # deferred: the step is the search tool selecting it (calling the search tool for another
        # name, as the trained `select:mcp__stock__get_stock`, is not the right tool)
        right = valid = exact = any(deferred_selects(name, args, scene.via, t) for name, args in calls)
    else:
        for name, args in calls:
            if name == declared:
                right = True
                valid = valid or t.valid(args)
                exact = exact or t.exact(args)
    return Verdict(agent, kind, declared, t.sentence, status, calls, right, valid, exact, text[:600])


def deferred_selects(name: str, args: Any, via: str, t: HeldOutTool) -> bool:
    """Whether a call is the search tool `via` selecting `t`'s tool by its full name."""
    query = (as_object(args) or {}).get("query", "") if name == via else ""
    return isinstance(query, str) and f"mcp__{t.server}__{t.tool}" in query


def rates(verdicts: list[Verdict]) -> dict[str, Any]:
    n = len(verdicts)
    return {"n": n, "right_tool": sum(v.right_tool for v in verdicts), "valid": sum(v.valid for v in verdicts),
            "exact": sum(v.exact for v in verdicts), "errors": sum(v.status != 200 for v in verdicts)}


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "mlx_relay"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def write_summary(out: Path, tag: str, args: argparse.Namespace, scenes: list[Scene], verdicts: list[Verdict]
                  ) -> str:
    """summary.json (every verdict) and summary.md (the table) of the verdicts so far; the table."""
    summary = {"commit": tag, "date": str(datetime.date.today()), "max_tokens": args.max_tokens, "seed": args.seed,
               "per_agent": {s.agent: {k: rates([v for v in verdicts if v.agent == s.agent and v.kind == k])
                                       for k in ("trained", "held-out")} for s in scenes},
               "verdicts": [asdict(v) for v in verdicts]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# The embedded model on held-out tools, `{tag}`, {summary['date']}", "",
             "`benchmarks/agents/held_out.py` (greedy, through `mlx-relay serve`, each agent's own recorded "
             "request): the right tool called (deferred: selected by the search tool) / with arguments valid "
             "for its schema / with the value asked for.", "",
             "| agent | trained tool: right / valid / exact | held-out tools: right / valid / exact |",
             "|---|---|---|"]
    for agent, r in summary["per_agent"].items():
        cells = [f"{r[k]['right_tool']} / {r[k]['valid']} / {r[k]['exact']} of {r[k]['n']}"
                 + (f" ({r[k]['errors']} errors)" if r[k]["errors"] else "") for k in ("trained", "held-out")]
        lines.append(f"| {agent} | {cells[0]} | {cells[1]} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20, help="held-out tools drawn per agent")
    ap.add_argument("--trained", type=int, default=10, help="requests with the trained tool per agent")
    ap.add_argument("--agents", default="", help="comma-separated (default: every agent with a call scene)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18100)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rejudge", type=Path, default=None, help="a run's summary.json: judge it again, run nothing")
    args = ap.parse_args()
    if args.rejudge is not None:
        print(rejudge(args.rejudge))
        return
    scenes = call_scenes([a for a in args.agents.split(",") if a] or None)
    tag = commit()
    out = args.out or ROOT / "benchmarks" / "results" / f"held-out-{datetime.date.today()}-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    log = (out / "server.log").open("w")
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "mlx-relay"), "serve", "--port", str(args.port)],
                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=os.environ | {"PYTHONPATH": str(ROOT)})
    verdicts: list[Verdict] = []
    try:
        wait_ready(url, server, timeout=900)
        with httpx.Client(base_url=url, timeout=1800) as client:
            for a, scene in enumerate(scenes):
                route, _ = body_of(ROOT / scene.file)
                for kind, b, t in jobs(scene, a, args.seed, args.trained, args.n):
                    r = client.post(route, json=prepared(route, b, args.max_tokens),
                                    headers={"authorization": "Bearer x", "x-api-key": "x",
                                             "anthropic-version": "2023-06-01"})
                    reply = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    ok = r.status_code == 200
                    v = judge(scene.agent, kind, scene, t, r.status_code, calls_of(route, reply) if ok else [],
                              json.dumps(reply) if ok else r.text)
                    verdicts.append(v)
                    print(f"{scene.agent:15s} {kind:8s} {r.status_code} right={v.right_tool:d} valid={v.valid:d} "
                          f"exact={v.exact:d} {v.calls[:2]}", flush=True)
                write_summary(out, tag, args, scenes[: a + 1], verdicts)  # what is done, should the run stop
    finally:
        server.terminate()
        server.wait(60)
    print(write_summary(out, tag, args, scenes, verdicts))


if __name__ == "__main__":
    main()

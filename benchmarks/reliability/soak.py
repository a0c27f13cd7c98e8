"""A bounded soak of a live server (issue 15, point 7): mixed routes, tools, structured output,
long prompts, multi-turn agents, client cancellations and malformed bodies, at a fixed
concurrency. What must hold: no 5xx, no stream without its terminal event, no request past its
deadline (a hang), and the server's RSS at the end within 10% of after warm-up (the prefix cache
flushed both times).

    python benchmarks/reliability/soak.py [--requests 2000] [--concurrency 32] [--out DIR]
        [--target URL --pid PID]   # an already running server (default: start the embedded model)

The request plan is seeded: two runs send the same requests. Prints and writes (JSON and
markdown): completed, errors by route/kind/status, 5xx, streams without a terminal event, hangs,
the RSS curve (sampled every second, the server and its children), and the prefix cache's
snapshot counters by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec

from mlx_relay.bench.machine import environment, process_rss_mb
from mlx_relay.bench.tables import rows_markdown
from mlx_relay.default_model import DEFAULT_MODEL_NAME
from mlx_relay.testing.serve_process import ServeProcess

MODEL = DEFAULT_MODEL_NAME  # the name the embedded model is served under
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["cmd"]}}},
]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
CODE = ("def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n\n"
        "class Config:\n    def __init__(self, path):\n        self.path = path\n        self.items = {}\n")
SYSTEM = "You are a careful coding agent. Read before you write. " * 30


class Plan(msgspec.Struct, frozen=True):
    route: str
    kind: str
    body: bytes
    stream: bool = False
    cancel_after: int = 0  # close the stream after this many lines (0: read to the end)


class Outcome(msgspec.Struct):
    route: str
    kind: str
    status: int
    seconds: float
    stream: bool
    terminal: bool | None = None  # streams: ended with the route's terminal event
    cancelled: bool = False
    error: str | None = None  # the error type (4xx/5xx bodies), or the client's exception
    hang: bool = False


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def plan(n: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    out: list[Plan] = []
    for i in range(n):
        r = rng.random()
        asks = ["Write a function that parses a line.", "Explain this:\n" + CODE,
                "Fix the bug:\n" + CODE * rng.randint(1, 6), "hi"]
        user = [{"role": "user", "content": rng.choice(asks)}]
        max_tokens = rng.choice([8, 16, 32, 64])
        stream = rng.random() < 0.6
        cancel = rng.randint(2, 6) if stream and rng.random() < 0.12 else 0
        if r < 0.10:  # malformed
            out.append(Plan("/v1/chat/completions" if rng.random() < 0.6 else "/v1/messages", "malformed",
                            _malformed(rng, user)))
        elif r < 0.35:
            body: dict[str, Any] = {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": stream}
            kind = "chat"
            if rng.random() < 0.3:
                body |= {"tools": TOOLS, "tool_choice": rng.choice(["auto", "required"])}
                kind = f"chat_tools_{body['tool_choice']}"
            elif rng.random() < 0.2:
                body["response_format"] = {"type": "json_object"}
                kind = "chat_json"
            if stream:
                body["stream_options"] = {"include_usage": True}
            out.append(Plan("/v1/chat/completions", kind, _json(body), stream, cancel))
        elif r < 0.50:  # an agent's turn: system prompt, tools, earlier turns with tool results
            turns = rng.randint(1, 4)
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
            for t in range(turns):
                call = {"id": f"call_{i}_{t}", "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "config.py"}'}}
                messages += [{"role": "user", "content": f"Step {t}: open config.py"},
                             {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": CODE}]
            body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "stream": stream}
            out.append(Plan("/v1/chat/completions", "agent_turn", _json(body), stream, cancel))
        elif r < 0.62:
            body = {"model": MODEL, "max_tokens": max_tokens, "messages": user, "stream": stream, "system": "Be brief."}
            kind = "messages"
            if rng.random() < 0.3:
                body |= {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": rng.choice(["auto", "any"])}}
                kind = f"messages_tools_{body['tool_choice']['type']}"
            out.append(Plan("/v1/messages", kind, _json(body), stream, cancel))
        elif r < 0.68:
            body = {"model": MODEL, "messages": user, "tools": ANTHROPIC_TOOLS}
            out.append(Plan("/v1/messages/count_tokens", "count_tokens", _json(body)))
        elif r < 0.80:
            body = {"model": MODEL, "input": user[0]["content"], "max_output_tokens": max_tokens, "stream": stream,
                    "instructions": "Be brief."}
            if rng.random() < 0.3:
                body |= {"tools": [{"type": "function", **t["function"]} for t in TOOLS], "tool_choice": "required"}
            out.append(Plan("/v1/responses", "responses", _json(body), stream, cancel))
        elif r < 0.90:
            body = {"model": MODEL, "prompt": CODE[: rng.randint(10, len(CODE))], "max_tokens": max_tokens,
                    "stream": stream}
            out.append(Plan("/v1/completions", "completions", _json(body), stream, cancel))
        else:  # a long prompt
            body = {"model": MODEL, "messages": [{"role": "user", "content": CODE * rng.randint(10, 25)}],
                    "max_tokens": 16, "stream": stream}
            out.append(Plan("/v1/chat/completions", "long_prompt", _json(body), stream, cancel))
    return out


def _malformed(rng: random.Random, user: list[dict[str, Any]]) -> bytes:
    good = _json({"model": MODEL, "messages": user, "max_tokens": 8})
    return rng.choice([good[: rng.randint(1, len(good) - 1)], good.replace(b"hi", b"h\xff\xfe"), b"[]", b"",
                       _json({"model": MODEL, "messages": user, "max_tokens": -5}),
                       _json({"model": MODEL, "messages": user, "seed": -1}),
                       _json({"model": MODEL, "messages": "not a list"}),
                       _json({"model": MODEL, "messages": user, "chat_template_kwargs": {"tokenize": True}}),
                       _json({"model": MODEL, "messages": user, "tools": [{"type": "function", "function": {
                           "name": "f", "parameters": {"type": "object", "properties": [1]}}}]}),
                       b'{"model": "x", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"])


def terminal(route: str, lines: list[str]) -> bool:
    if not lines:
        return False
    if route == "/v1/messages":
        return lines[-2:-1] == ["event: message_stop"] or "event: error" in lines[-2:]
    if route == "/v1/responses":
        return any(e in " ".join(lines[-2:]) for e in ("response.completed", "response.incomplete", "response.failed"))
    return lines[-1] == "data: [DONE]"


async def run_one(client: httpx.AsyncClient, url: str, p: Plan, timeout_s: float) -> Outcome:
    tic = time.perf_counter()
    out = Outcome(p.route, p.kind, 0, 0.0, p.stream)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url + p.route, content=p.body,
                                     headers={"content-type": "application/json"}) as r:
                out.status = r.status_code
                lines: list[str] = []
                async for line in r.aiter_lines():
                    if line.strip():
                        lines.append(line)
                    if p.cancel_after and len(lines) >= p.cancel_after and r.status_code == 200:
                        out.cancelled = True
                        break
                if r.status_code >= 400:
                    out.error = _error_type(lines)
                elif p.stream and r.headers.get("content-type", "").startswith("text/event-stream") \
                        and not out.cancelled:
                    out.terminal = terminal(p.route, lines)
    except TimeoutError:
        out.hang = True
    except httpx.HTTPError as exc:
        out.error = f"client:{type(exc).__name__}"
    out.seconds = time.perf_counter() - tic
    return out


def _error_type(lines: list[str]) -> str:
    try:
        body = json.loads("\n".join(lines))
        err = body.get("error", {})
        return str(err.get("code") or err.get("type") or "?")
    except (json.JSONDecodeError, AttributeError):
        return "not_json"


async def sample_rss(pid: int, curve: list[tuple[float, float]], t0: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        curve.append((round(time.perf_counter() - t0, 1), process_rss_mb(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


async def drive(url: str, plans: list[Plan], concurrency: int, timeout_s: float) -> list[Outcome]:
    queue: asyncio.Queue[Plan] = asyncio.Queue()
    for p in plans:
        queue.put_nowait(p)
    results: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await run_one(client, url, queue.get_nowait(), timeout_s))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def flush(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as client:
        await client.post(url + "/v1/cache/flush")
        return dict((await client.get(url + "/v1/cache/stats")).json())


def summarize(results: list[Outcome]) -> dict[str, Any]:
    by_status = Counter(r.status for r in results)
    errors = Counter(f"{r.route} {r.status} {r.error}" for r in results if r.error)
    return {
        "requests": len(results),
        "completed_2xx": sum(1 for r in results if 200 <= r.status < 300 and not r.hang),
        "status_counts": dict(sorted(by_status.items())),
        "server_errors_5xx": sum(1 for r in results if r.status >= 500),
        "streams_checked": sum(1 for r in results if r.terminal is not None),
        "streams_without_terminal_event": sum(1 for r in results if r.terminal is False),
        "cancelled_by_client": sum(1 for r in results if r.cancelled),
        "hangs": sum(1 for r in results if r.hang),
        "client_errors": sum(1 for r in results if (r.error or "").startswith("client:")),
        "errors_by_kind": dict(errors.most_common()),
        "by_kind": dict(Counter(r.kind for r in results)),
        "seconds_median": round(statistics.median(r.seconds for r in results), 3),
        "seconds_max": round(max(r.seconds for r in results), 3),
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    env = environment()  # the checkout the server runs, taken before it starts
    proc = None
    if args.target is None:
        proc = ServeProcess(*([args.model] if args.model else []), "--log-level", "warning")
        url, pid = proc.url, proc.pid
    else:
        url, pid = args.target, args.pid
    try:
        await drive(url, plan(args.warmup, args.seed + 1), args.concurrency, args.timeout)
        await flush(url)
        await asyncio.sleep(2.0)
        after_warmup = process_rss_mb(pid)
        curve: list[tuple[float, float]] = []
        stop = asyncio.Event()
        t0 = time.perf_counter()
        sampler = asyncio.create_task(sample_rss(pid, curve, t0, stop))
        results = await drive(url, plan(args.requests, args.seed), args.concurrency, args.timeout)
        seconds = time.perf_counter() - t0
        async with httpx.AsyncClient(timeout=30) as client:
            cache = (await client.get(url + "/v1/cache/stats")).json()
            health = (await client.get(url + "/health")).json()
        await flush(url)
        await asyncio.sleep(2.0)
        at_end = process_rss_mb(pid)
        stop.set()
        await sampler
    finally:
        if proc is not None:
            proc.stop()
    summary = summarize(results)
    return {"summary": summary, "seconds": round(seconds, 1), "concurrency": args.concurrency,
            "rss_mb": {"after_warmup": after_warmup, "max": max(v for _, v in curve), "at_end": at_end,
                       "end_vs_warmup": round(at_end / after_warmup, 3)},
            "rss_curve": curve, "prefix_cache_before_flush": cache.get("prefix_cache"), "health_after": health,
            "environment": msgspec.to_builtins(env), "seed": args.seed}


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    env = report["environment"]
    machine = env["machine"]
    lines = [f"# Soak: {s['requests']} requests at concurrency {report['concurrency']}",
             f"commit {env['commit']}, {env['date']}, {machine['processor']} ({machine['cpu_count']} cores), "
             f"{report['seconds']} s", "",
             rows_markdown([{k: v for k, v in s.items() if not isinstance(v, dict)}]), "",
             "status counts: " + json.dumps(s["status_counts"]), "",
             "## Errors by route, status and type", rows_markdown(
                 [{"route status type": k, "count": v} for k, v in s["errors_by_kind"].items()]), "",
             "## RSS (MB, the server and its children)", rows_markdown([report["rss_mb"]]), ""]
    pc = report.get("prefix_cache_before_flush") or {}
    if pc.get("by_kind"):
        lines += ["## Prefix cache by snapshot kind (before the final flush)",
                  rows_markdown([{"kind": k, **v} for k, v in pc["by_kind"].items()]),
                  f"hits {pc.get('hits')}, misses {pc.get('misses')}, turn snapshots skipped (one-shot chats) "
                  f"{pc.get('turns_skipped')}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as a hang")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--model", default=None, help="checkpoint to serve (default: the embedded model)")
    parser.add_argument("--target", default=None, help="URL of a running server (with --pid)")
    parser.add_argument("--pid", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.target is not None and args.pid is None:
        parser.error("--target needs --pid (the server's RSS is measured)")
    report = asyncio.run(soak(args))
    md = markdown(report)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "soak.json").write_text(json.dumps(report, indent=1))
        (args.out / "soak.md").write_text(md + "\n")
    s = report["summary"]
    ok = s["server_errors_5xx"] == 0 and s["streams_without_terminal_event"] == 0 and s["hangs"] == 0 \
        and report["rss_mb"]["end_vs_warmup"] <= 1.10
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

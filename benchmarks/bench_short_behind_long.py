"""A short request beside long prefills (issue 30, point 6), measured on a server process.

`mlx-relay serve` on the embedded model (relay-tiny-agent, 32K context) is started once per
`--budget` (its `--max-num-batched-tokens`; "default" leaves the flag out) and `--stall-factor`
(its `--decode-stall-factor`; "default" leaves the flag out, 0 turns decode priority off). Then,
in one run:

(a) short alone:   a streamed ~22-token chat request (greedy, at most `--short-tokens`, 8), `--repeats`
                   times: its time to first token (TTFT) and inter-token latency (ITL: first to
                   last token over the tokens between, from the usage count, so an MTP round's two
                   tokens in one delta count as two);
(b) long alone:    `--longs` prompts of `--long-tokens` random token ids (raw completions,
                   1 token each) sent together: each one's TTFT (its whole request);
(c) long + short:  the same long prompts (fresh ids: no prefix-cache hit) and, from `--lead`
                   seconds after they were sent until they are done, the short request again and
                   again, one at a time: its TTFT and ITL while they prefill, and theirs.

The issue's targets on this CPU: in (c) the short request's TTFT within 3 s and its ITL within
3x its ITL in (a); the long prompts' TTFT in (c) not much worse than in (b). At a6ef0d4 (before
the step budget) the issue measured 30.6 s to the first token and 157 s for 8 tokens.

    python benchmarks/bench_short_behind_long.py [--budget default 2048] [--stall-factor default 0]
        [--long-tokens 18000]
        [--longs 2] [--repeats 5] [--out DIR]

Writes results.json and results.md under --out (with the commit, the machine and `uptime`'s load
before and after: other jobs on the box make these numbers noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from mlx_relay.bench.machine import environment
from mlx_relay.bench.tables import rows_markdown
from mlx_relay.testing.serve_process import ServeProcess

SHORT_TEXTS = ["Count from one to ten in words, please.", "List three colours and three animals, please.",
               "Name the days of the week in order, please.", "Say hello and then spell your name, please."]


def serve(budget: int | None, factor: str = "default") -> ServeProcess:
    flags = [] if budget is None else ["--max-num-batched-tokens", str(budget)]
    flags += [] if factor == "default" else ["--decode-stall-factor", factor]
    return ServeProcess("--served-model-name", "tiny", *flags)


def load() -> str:
    """`uptime`'s load averages (1, 5, 15 minutes)."""
    return " ".join(os.getloadavg().__repr__().strip("()").split(", "))


def short_request(url: str, text: str, max_tokens: int = 8) -> dict[str, Any]:
    """One streamed short chat request: TTFT, ITL, tokens (client-side times)."""
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True}}
    tic = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if any(v for k, v in delta.items() if k != "role"):
                    stamps.append(time.perf_counter())
    tokens = int(usage.get("completion_tokens", len(stamps)))
    first = stamps[0] - tic if stamps else float("nan")
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if stamps and tokens > 1 else float("nan")
    return {"ttft_s": first, "itl_s": itl, "tokens": tokens, "prompt_tokens": usage.get("prompt_tokens"),
            "total_s": time.perf_counter() - tic}


def long_requests(url: str, count: int, tokens: int, seed: int) -> tuple[list[threading.Thread], list[float]]:
    """`count` raw completions of `tokens` random ids each (1 token out), sent together; their
    latencies (each one's TTFT) land in the returned list as they finish."""
    rng = random.Random(seed)
    times: list[float] = []

    def send(prompt: list[int]) -> None:
        tic = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                       timeout=3600)
        r.raise_for_status()
        times.append(time.perf_counter() - tic)

    threads = [threading.Thread(target=send, args=([rng.randrange(3, 990) for _ in range(tokens)],))
               for _ in range(count)]
    for t in threads:
        t.start()
    return threads, times


def summary(name: str, budget: str, shorts: list[dict[str, Any]], longs: list[float],
            alone: dict[str, float] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"budget": budget, "case": name, "n": len(shorts)}
    if shorts:
        ttft = [s["ttft_s"] for s in shorts]
        itl = [s["itl_s"] for s in shorts if s["itl_s"] == s["itl_s"]]
        row |= {"short_ttft_median_s": round(statistics.median(ttft), 3), "short_ttft_max_s": round(max(ttft), 3),
                "short_itl_median_s": round(statistics.median(itl), 4) if itl else None,
                "short_itl_max_s": round(max(itl), 4) if itl else None}
        if alone is not None and itl and alone.get("itl"):
            row["itl_vs_alone"] = round(statistics.median(itl) / alone["itl"], 2)
    if longs:
        row["long_ttft_s"] = [round(t, 1) for t in sorted(longs)]
    return row


def run_budget(budget: int | None, factor: str, args: argparse.Namespace, seed: int
               ) -> tuple[list[dict[str, Any]], dict]:
    label = ("default" if budget is None else str(budget)) + ("" if factor == "default" else f", stall {factor}")
    server = serve(budget, factor)
    raw: dict[str, Any] = {"budget": label}
    try:
        short_request(server.url, SHORT_TEXTS[0])  # warm the path
        alone = [short_request(server.url, SHORT_TEXTS[i % len(SHORT_TEXTS)], args.short_tokens)
                 for i in range(args.repeats)]
        raw["short_alone"] = alone
        base = {"itl": statistics.median([s["itl_s"] for s in alone if s["itl_s"] == s["itl_s"]] or [float("nan")])}
        threads, long_alone = long_requests(server.url, args.longs, args.long_tokens, seed)
        for t in threads:
            t.join()
        raw["long_alone"] = long_alone
        threads, long_with = long_requests(server.url, args.longs, args.long_tokens, seed + 1)
        time.sleep(args.lead)
        beside: list[dict[str, Any]] = []
        i = 0
        while any(t.is_alive() for t in threads) and len(beside) < args.max_beside:
            s = short_request(server.url, SHORT_TEXTS[i % len(SHORT_TEXTS)], args.short_tokens)
            s["longs_done_after"] = len(long_with)  # long prompts already done when it ended
            beside.append(s)
            i += 1
            print(f"[{label}] beside #{i}: ttft {s['ttft_s']:.2f}s itl {s['itl_s']:.3f}s ({s['tokens']} tokens)",
                  flush=True)
        for t in threads:
            t.join()
        raw["long_with_short"], raw["short_beside"] = long_with, beside
        while_prefill = [s for s in beside if s["longs_done_after"] == 0]
    finally:
        server.stop()
    rows = [summary("short alone", label, alone, [], None),
            summary("long alone", label, [], long_alone, None),
            summary("short while longs prefill", label, while_prefill, long_with, base),
            summary("short, all beside longs", label, beside, [], base)]
    return rows, raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", nargs="+", default=["default"], help="--max-num-batched-tokens values ('default')")
    p.add_argument("--stall-factor", nargs="+", default=["default"],
                   help="--decode-stall-factor values ('default'; 0: decode priority off)")
    p.add_argument("--long-tokens", type=int, default=18000)
    p.add_argument("--short-tokens", type=int, default=8, help="the short request's max_tokens")
    p.add_argument("--longs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lead", type=float, default=2.0, help="seconds between the long prompts and the first short one")
    p.add_argument("--max-beside", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    loads = {"before": load()}
    env = msgspec.to_builtins(environment())  # the commit that runs, before anything changes it
    rows: list[dict[str, Any]] = []
    raws = []
    runs = [(b, f) for b in args.budget for f in args.stall_factor]
    for j, (b, f) in enumerate(runs):
        r, raw = run_budget(None if b == "default" else int(b), f, args, seed=100 * j)
        rows += r
        raws.append(raw)
        print(rows_markdown(r), flush=True)
    loads["after"] = load()
    table = rows_markdown(rows)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"environment": env, "load": loads, "args": vars(args) | {"out": None},
               "rows": rows, "raw": raws}
        (args.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
        (args.out / "results.md").write_text(f"load average (1, 5, 15 min) before: {loads['before']}, "
                                             f"after: {loads['after']}\n\n{table}\n")


if __name__ == "__main__":
    main()

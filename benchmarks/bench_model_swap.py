"""Several models under one memory budget (issue 34, point 6): what a swap costs and what a steady
mix of two models serves against one model alone.

One server (`mlx-relay serve --model a=A --model b=B --memory-budget-gb G`, run in this process
through the same `LiveServer` the tests use; every model's engine is a process of its own), a
budget that holds one of the two models at a time, streamed chat requests of `--max-tokens`:

  - `cold`: the first request of model a, from nothing loaded: its TTFT includes the load;
  - `warm`: then `--requests` to a alone, sequentially: TTFT and out tokens/s with a loaded;
  - `swap`: `--swaps` requests alternating b, a, b, ...: each must unload the other model first;
    TTFT (unload + load + prefill + first token), the load seconds the pool measured;
  - `mix`: the swaps' out tokens over their wall time, against `warm`'s (a alone): the steady mix's
    throughput as a share of one model's;
  - with `--clients N`: N clients at once, each sending `--client-requests` requests back to back,
    first all to a (`alone_c`), then half to a and half to b (`mix_c`): out tokens/s of each, the
    loads the mix took (a model that the other waits for admits no new request until it is swapped
    out, so each load serves the requests that waited for it: the pool's fairness).

    python benchmarks/bench_model_swap.py A_DIR B_DIR --budget-gb 0.6 --requests 4 --swaps 4 --out swap.json

The figures go to stdout as a table, and with `--out` as JSON (with the machine and the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from mlx_relay.config import build_config
from mlx_relay.pool.build import pool_config
from mlx_relay.pool.models_file import ModelEntry, NamedEntry
from mlx_relay.pool.pool import ModelPool
from mlx_relay.testing.live_server import LiveServer

PROMPT = "Write a Python function that parses a CSV line into fields, handling quoted commas."


def one_request(url: str, model: str, max_tokens: int) -> dict[str, float]:
    """A streamed chat request: its TTFT, its out tokens and the seconds they took."""
    tic = time.perf_counter()
    first: float | None = None
    tokens = 0
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - tic
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    total = time.perf_counter() - tic
    return {"ttft_s": round(first or total, 4), "seconds": round(total, 4), "tokens": tokens}


def load_seconds(url: str) -> dict[str, float]:
    """The pool's `model_load_seconds_sum` per model."""
    text = httpx.get(url + "/metrics", timeout=60).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^mlx_relay:model_load_seconds_sum\{model_name="([^"]+)"\} (\S+)$', text, re.M)}


def loads_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=60).text
    return sum(float(m.group(1)) for m in re.finditer(r"^mlx_relay:model_loads_total\{[^}]*\} (\S+)$", text, re.M))


def concurrent_phases(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """N clients at once, all to a, then half to a and half to b: out tokens/s and the mix's loads."""

    def phase(models: list[str]) -> tuple[float, list[dict[str, float]]]:
        def client(model: str) -> list[dict[str, float]]:
            return [one_request(url, model, args.max_tokens) for _ in range(args.client_requests)]

        tic = time.perf_counter()
        with ThreadPoolExecutor(len(models)) as pool:
            results = [r for rs in pool.map(client, models) for r in rs]
        return time.perf_counter() - tic, results

    alone_s, alone = phase(["a"] * args.clients)
    before = loads_total(url)
    mix_s, mix = phase(["a" if i % 2 == 0 else "b" for i in range(args.clients)])
    alone_tps = sum(r["tokens"] for r in alone) / alone_s
    mix_tps = sum(r["tokens"] for r in mix) / mix_s
    return {"alone_seconds": round(alone_s, 3), "mix_seconds": round(mix_s, 3),
            "alone_out_tok_s": round(alone_tps, 2), "mix_out_tok_s": round(mix_tps, 2),
            "mix_vs_alone": round(mix_tps / alone_tps, 4), "mix_loads": int(loads_total(url) - before),
            "mix_ttft_s": sorted(r["ttft_s"] for r in mix)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_a")
    ap.add_argument("model_b")
    ap.add_argument("--budget-gb", type=float, required=True, help="must hold one model's reservation, not two")
    ap.add_argument("--requests", type=int, default=4, help="requests to model a alone (warm)")
    ap.add_argument("--swaps", type=int, default=4, help="requests alternating b, a, ... (each a swap)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--no-warmup", action="store_true", help="load without the engine's kernel warm-up")
    ap.add_argument("--clients", type=int, default=0, help="concurrent clients for the alone_c / mix_c phases")
    ap.add_argument("--client-requests", type=int, default=4, help="requests per client in those phases")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    settings: dict[str, Any] = dict(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                    warmup=not args.no_warmup)
    entries = [NamedEntry(n, ModelEntry(path=path), n, n) for n, path in (("a", args.model_a), ("b", args.model_b))]
    budget = int(args.budget_gb * (1 << 30))
    pool = pool_config(entries, settings, budget=budget, load_wait_s=1800)
    sizes = {m.name: m.reservation.total for m in pool.models}
    if sum(sizes.values()) <= budget:
        raise SystemExit(f"the budget holds both models ({sizes}); give one that holds one")
    first = pool.models[0].config
    front = build_config(first.model, served_model_name="a", **settings)
    with LiveServer(front, boot=ModelPool.boot(pool), timeout_s=1800) as live:
        url = live.url
        cold = one_request(url, "a", args.max_tokens)
        warm = [one_request(url, "a", args.max_tokens) for _ in range(args.requests)]
        swaps = []
        for i in range(args.swaps):
            model = "b" if i % 2 == 0 else "a"
            loads = load_seconds(url)
            result = one_request(url, model, args.max_tokens)
            after = load_seconds(url)
            result["model"] = model  # type: ignore[assignment]
            result["load_s"] = round(after.get(model, 0.0) - loads.get(model, 0.0), 3)
            swaps.append(result)
        concurrent = concurrent_phases(url, args) if args.clients else None
    warm_tps = sum(r["tokens"] for r in warm) / sum(r["seconds"] for r in warm)
    mix_tps = sum(r["tokens"] for r in swaps) / sum(r["seconds"] for r in swaps)
    report = {
        "machine": platform.node(), "commit": _commit(), "budget_bytes": budget, "reserved_bytes": sizes,
        "settings": settings, "max_tokens": args.max_tokens,
        "cold": cold, "warm": warm, "swaps": swaps, "concurrent": concurrent,
        "summary": {
            "cold_ttft_s": cold["ttft_s"],
            "warm_ttft_s_median": statistics.median(r["ttft_s"] for r in warm),
            "swap_ttft_s_median": statistics.median(r["ttft_s"] for r in swaps),
            "swap_ttft_s_range": [min(r["ttft_s"] for r in swaps), max(r["ttft_s"] for r in swaps)],
            "swap_load_s_median": statistics.median(r["load_s"] for r in swaps),
            "warm_out_tok_s": round(warm_tps, 2),
            "mix_out_tok_s": round(mix_tps, 2),
            "mix_vs_alone": round(mix_tps / warm_tps, 4),
        },
    }
    s = report["summary"]
    print(f"| cold TTFT | warm TTFT (median) | swap TTFT (median, range) | swap load | one model alone | "
          f"steady a/b mix | mix / alone |\n|---|---|---|---|---|---|---|\n"
          f"| {s['cold_ttft_s']:.2f} s | {s['warm_ttft_s_median']:.3f} s | {s['swap_ttft_s_median']:.2f} s "
          f"({s['swap_ttft_s_range'][0]:.2f}-{s['swap_ttft_s_range'][1]:.2f}) | {s['swap_load_s_median']:.2f} s | "
          f"{s['warm_out_tok_s']:.1f} tok/s | {s['mix_out_tok_s']:.2f} tok/s | {s['mix_vs_alone']:.3f}x |")
    if concurrent is not None:
        c = concurrent
        print(f"\n{args.clients} clients x {args.client_requests} requests: a alone {c['alone_out_tok_s']:.1f} "
              f"tok/s; a/b mix {c['mix_out_tok_s']:.1f} tok/s ({c['mix_vs_alone']:.3f}x) with {c['mix_loads']} loads")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))


def _commit() -> str:
    if commit := os.environ.get("COMMIT"):  # a copy of the tree without its .git (the GPU machine)
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()

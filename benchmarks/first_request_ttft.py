"""First requests at new prompt lengths against a running server (issue 17.6): after the server
reports ready, does a prompt length never seen before wait on kernel compilation?

For each of `--count` random prompt lengths (seeded, between `--min` and `--max` tokens), sends
one streaming `/v1/completions` request with that many token ids (max_tokens 1, greedy), then a
second of the same length with other tokens (so the prefix cache cannot serve it), and reports
both times to first token and their ratio. A ratio near 1 means the first request of a length
met only shapes the warm-up had already run; a first-shape stall shows as a ratio of several.

    python benchmarks/first_request_ttft.py http://127.0.0.1:8000 [--model NAME] [--count 10]
        [--min 100] [--max 8000] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from mlx_relay.bench.machine import source_commit


def wait_ready(client: httpx.Client, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/health").json().get("status") == "ready":
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    raise SystemExit("the server did not report ready")


def ttft(client: httpx.Client, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    tic = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"the server refused a {len(ids)}-token prompt: {event['error'].get('message')}")
            if event.get("choices"):
                return time.perf_counter() - tic
    raise SystemExit("the stream ended without a token")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--min", type=int, default=100)
    p.add_argument("--max", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=150_000, help="token ids are drawn from [1000, vocab)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    lengths = [rng.randint(args.min, args.max) for _ in range(args.count)]
    with httpx.Client(base_url=args.url, timeout=600) as client:
        wait_ready(client, 3600)
        model = args.model or client.get("/v1/models").json()["data"][0]["id"]
        rows = []
        for n in lengths:
            first = ttft(client, model, [rng.randrange(1000, args.vocab) for _ in range(n)])
            repeat = ttft(client, model, [rng.randrange(1000, args.vocab) for _ in range(n)])
            rows.append({"tokens": n, "first_s": round(first, 4), "repeat_s": round(repeat, 4),
                         "ratio": round(first / repeat, 3)})
            print(f"{n:6d} tokens: first {first:7.3f} s  repeat {repeat:7.3f} s  ratio {first / repeat:5.2f}",
                  flush=True)
    worst = max(r["ratio"] for r in rows)
    print(f"worst first/repeat {worst:.2f}, median {statistics.median(r['ratio'] for r in rows):.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"commit": source_commit(), "url": args.url, "lengths": lengths,
                                         "rows": rows, "worst_ratio": worst}, indent=2))


if __name__ == "__main__":
    main()

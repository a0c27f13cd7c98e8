"""Greedy completion tok/s of a running server: one stream, then four at once (docs/pipeline.md).

Start the server under test first, unsharded or as a pipeline, then point this at it:

    mlx-relay serve MODEL --port 8000
    mlx.launch -n 2 --backend ring -- mlx-relay serve MODEL --pipeline --port 8000
    python benchmarks/bench_pipeline.py http://127.0.0.1:8000 [--max-tokens 128]

Each request is a short chat prompt at temperature 0; tok/s is completion tokens over wall time
(3 requests one at a time, then 8 requests 4 at a time), after one short warm request.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]

    def one(i: int, max_tokens: int = args.max_tokens) -> int:
        r = httpx.post(args.url + "/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Write a Python function number {i} that parses a CSV file."}]})
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    one(99, 8)
    for streams, requests in ((1, 3), (4, 8)):
        tic = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            tokens = sum(pool.map(one, range(requests)))
        seconds = time.perf_counter() - tic
        print(f"{streams} stream(s): {requests} requests, {tokens} tokens in {seconds:.2f}s "
              f"= {tokens / seconds:.1f} tok/s")


if __name__ == "__main__":
    main()

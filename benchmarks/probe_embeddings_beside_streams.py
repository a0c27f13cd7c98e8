"""Embedding requests beside running streams (issue 47.1: "batched requests share the engine fairly
with decoding streams"), against a server with `--embedding-model`.

In one run, after `--settle` seconds of streams:

(a) streams alone:      `--streams` workers sending short streamed chats back to back
                        (`probe_long_beside_streams.Streams`); every gap between two deltas of one
                        stream over `--window` seconds is an inter-token latency (ITL) sample;
(b) embeddings beside:  the same streams go on while `--clients` clients send embedding requests
                        back to back for `--window` seconds, each `--inputs` random token-id inputs
                        of `--input-tokens` tokens: the streams' ITL then, and the embeddings' rate
                        (inputs and tokens a second, a request's latency p50 / p90);
(c) embeddings alone:   the same embedding clients with no streams, their rate.

    python benchmarks/probe_embeddings_beside_streams.py URL --embed-model NAME [--streams 8]
        [--clients 2] [--inputs 32] [--input-tokens 512] [--window 20] [--json FILE]

What it says: the streams' ITL p50 / p90 beside the embeddings against alone (a ratio), and the
share of the embeddings' rate kept beside the streams. Timing is client-side.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_long_beside_streams import Streams, itl_stats, percentile, report


class Embedders:
    """`count` clients sending embedding requests back to back until stopped; each request's
    (end time, seconds, inputs, tokens) recorded."""

    def __init__(self, client: httpx.AsyncClient, model: str, count: int, inputs: int, tokens: int, vocab: int) -> None:
        self.client, self.model, self.count = client, model, count
        self.inputs, self.tokens, self.vocab = inputs, tokens, vocab
        self.done: list[tuple[float, float, int, int]] = []
        self.stop = asyncio.Event()

    async def worker(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            ids = [[rng.randrange(10, self.vocab - 10) for _ in range(self.tokens)] for _ in range(self.inputs)]
            tic = time.perf_counter()
            r = await self.client.post("/v1/embeddings", json={"model": self.model, "input": ids,
                                                                "encoding_format": "base64"})
            r.raise_for_status()
            now = time.perf_counter()
            self.done.append((now, now - tic, self.inputs, self.inputs * self.tokens))

    async def run(self, seconds: float) -> dict[str, Any]:
        self.stop.clear()
        start = len(self.done)
        workers = [asyncio.create_task(self.worker(i)) for i in range(self.count)]
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        self.stop.set()
        await asyncio.gather(*workers)
        span = time.perf_counter() - t0
        done = self.done[start:]
        lat = [d[1] for d in done]
        return {"requests": len(done), "inputs_s": round(sum(d[2] for d in done) / span, 1),
                "tokens_s": round(sum(d[3] for d in done) / span, 1),
                "latency_p50_s": round(percentile(lat, 0.5) or 0, 3),
                "latency_p90_s": round(percentile(lat, 0.9) or 0, 3)}


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=args.url, timeout=3600) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        out: dict[str, Any] = {"url": args.url, "model": model, "embed_model": args.embed_model,
                               "streams": args.streams, "clients": args.clients, "inputs": args.inputs,
                               "input_tokens": args.input_tokens}
        embedders = Embedders(client, args.embed_model, args.clients, args.inputs, args.input_tokens, args.vocab)
        await embedders.run(min(3.0, args.window))  # warm every batch shape
        streams = Streams(client, model, args.streams, args.stream_tokens)
        streams.start()
        out["streams_alone_itl"] = await streams.alone(args.settle, args.window)
        out["embeddings_beside"] = await embedders.run(args.window)
        t2 = time.perf_counter()
        out["streams_beside_itl"] = itl_stats(streams.between(t2 - args.window, t2))
        await streams.close()
        out["embeddings_alone"] = await embedders.run(args.window)
    for q in ("p50_ms", "p90_ms"):
        a, b = out["streams_alone_itl"][q], out["streams_beside_itl"][q]
        out[f"itl_{q[:3]}_ratio"] = round(b / a, 2) if a and b else None
    alone = out["embeddings_alone"]["tokens_s"]
    out["embedding_rate_kept"] = round(out["embeddings_beside"]["tokens_s"] / alone, 3) if alone else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--model", default=None, help="the chat model (default: the first listed)")
    p.add_argument("--embed-model", required=True)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--inputs", type=int, default=32)
    p.add_argument("--input-tokens", type=int, default=512)
    p.add_argument("--vocab", type=int, default=150000, help="token ids are drawn below this")
    p.add_argument("--settle", type=float, default=5.0)
    p.add_argument("--window", type=float, default=20.0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    out = report(asyncio.run(probe(args)), args.json)
    print(f"streams' ITL p50 {out['itl_p50_ratio']}x, p90 {out['itl_p90_ratio']}x beside embeddings; "
          f"embeddings kept {out['embedding_rate_kept']} of their rate alone")


if __name__ == "__main__":
    main()

"""A long prompt prefilling beside running streams (issue 30, point 6's GPU probe), against a server.

Against a running server (ours or any OpenAI-compatible one), in one run:

(a) long alone:   one prompt of `--long-tokens` random token ids (raw completion, 1 token out):
                  its time to first token (TTFT: the whole request), after one such prompt of
                  other ids warmed every chunk shape and context length (its TTFT reported as
                  `long_first_ttft_s`: on an H200 it was 1.6x the warm one, 2026-11-28);
(b) streams:      `--streams` workers, each sending short chat requests (short_chat's shape: a
                  one-line instruction, `--stream-tokens` tokens out, greedy) one after another,
                  streamed; for `--window` seconds every gap between two content deltas of one
                  stream is an inter-token latency (ITL) sample: p50/p90/p99;
(c) beside:       the same streams go on, and a new long prompt (fresh ids) is sent: its TTFT, and
                  the streams' ITL samples while it is in flight.

Targets (issue 43.3, on the 35B-A3B shape, c=8): the streams' ITL p90 in (c) within 2x of (b),
the long prompt's TTFT in (c) within 1.3x of (a).

    python benchmarks/probe_long_beside_streams.py URL [--streams 8] [--long-tokens 30000]
        [--vocab 240000] [--window 30] [--json FILE]

Timing is client-side; deltas that carry several tokens (MTP) count as one gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx

INSTRUCTIONS = ["Summarize the paragraph in one sentence.", "List three facts about the ocean.",
                "Explain recursion to a child.", "Write a haiku about autumn.", "Give two uses of a hammer.",
                "Name four planets and one moon.", "Describe a sunrise briefly.", "Suggest a name for a cat."]


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def itl_stats(gaps: list[float]) -> dict[str, Any]:
    return {"n": len(gaps), "p50_ms": _ms(percentile(gaps, 0.5)), "p90_ms": _ms(percentile(gaps, 0.9)),
            "p99_ms": _ms(percentile(gaps, 0.99)), "max_ms": _ms(max(gaps) if gaps else None)}


def share_over(gaps: list[float], bound_s: float | None) -> float | None:
    """The share of `gaps` longer than `bound_s`: what a p90 hides (a policy that stalls the streams
    for half a second every tenth token keeps its p90 and not its p99)."""
    if not gaps or bound_s is None:
        return None
    return round(sum(g > bound_s for g in gaps) / len(gaps), 4)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 2)


class Streams:
    """`count` workers sending short streamed chats back to back; gaps recorded with their times."""

    def __init__(self, client: httpx.AsyncClient, model: str, count: int, tokens: int) -> None:
        self.client, self.model, self.count, self.tokens = client, model, count, tokens
        self.gaps: list[tuple[float, float]] = []  # (time of the later delta, gap)
        self.stop = asyncio.Event()

    async def worker(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            body = {"model": self.model, "messages": [{"role": "user", "content": INSTRUCTIONS[(i + n) % 8]}],
                    "max_tokens": self.tokens, "temperature": 0, "stream": True}
            n += 1
            last = None
            async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if any(v for c in chunk.get("choices", []) for k, v in c.get("delta", {}).items() if k != "role"):
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append((now, now - last))
                        last = now

    def between(self, start: float, end: float) -> list[float]:
        return [g for t, g in self.gaps if start <= t <= end]

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.worker(i)) for i in range(self.count)]

    async def alone(self, settle: float, window: float) -> dict[str, Any]:
        """The streams' ITL over `window` seconds, after `settle` seconds of them (`start` first)."""
        await asyncio.sleep(settle)
        t0 = time.perf_counter()
        await asyncio.sleep(window)
        return itl_stats(self.between(t0, time.perf_counter()))

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def long_request(client: httpx.AsyncClient, model: str, tokens: int, vocab: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt = [rng.randrange(10, vocab - 10) for _ in range(tokens)]
    tic = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - tic


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=args.url, timeout=3600) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        out: dict[str, Any] = {"url": args.url, "model": model, "streams": args.streams,
                               "long_tokens": args.long_tokens}
        await long_request(client, model, 512, args.vocab, seed=7)  # warm the path
        out["long_first_ttft_s"] = round(await long_request(client, model, args.long_tokens, args.vocab, 3), 3)
        out["long_alone_ttft_s"] = round(await long_request(client, model, args.long_tokens, args.vocab, 1), 3)
        streams = Streams(client, model, args.streams, args.stream_tokens)
        streams.start()
        out["streams_alone_itl"] = await streams.alone(args.settle, args.window)
        ttft = await long_request(client, model, args.long_tokens, args.vocab, 2)
        t2 = time.perf_counter()
        out["long_beside_ttft_s"] = round(ttft, 3)
        out["_beside_gaps"] = streams.between(t2 - ttft, t2)
        out["streams_beside_itl"] = itl_stats(out["_beside_gaps"])
        await streams.close()
    alone_p90 = out["streams_alone_itl"]["p90_ms"]
    out["beside_itl_share_over_2x_alone_p90"] = share_over(out.pop("_beside_gaps"),
                                                           2 * alone_p90 / 1000 if alone_p90 else None)
    a, b = out["streams_alone_itl"]["p90_ms"], out["streams_beside_itl"]["p90_ms"]
    out["itl_p90_ratio"] = round(b / a, 2) if a and b else None
    out["long_ttft_ratio"] = round(out["long_beside_ttft_s"] / out["long_alone_ttft_s"], 3)
    out["targets_met"] = {"itl_p90_within_2x": out["itl_p90_ratio"] is not None and out["itl_p90_ratio"] <= 2,
                          "long_ttft_within_1.3x": out["long_ttft_ratio"] <= 1.3}
    return out


def report(out: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """A probe's results printed as JSON, and written to `path` where one is given."""
    print(json.dumps(out, indent=1))
    if path is not None:
        path.write_text(json.dumps(out, indent=1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=30000)
    p.add_argument("--vocab", type=int, default=240000, help="token ids are drawn below this")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of streams before the window")
    p.add_argument("--window", type=float, default=30.0, help="seconds of streams measured alone")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    out = report(asyncio.run(probe(args)), args.json)
    print(f"ITL p90 {out['itl_p90_ratio']}x, long TTFT {out['long_ttft_ratio']}x (targets: {out['targets_met']})")


if __name__ == "__main__":
    main()

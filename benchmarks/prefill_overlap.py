"""Whether a decode step and a prefill chunk can share the GPU at once (issue 43.3): the decode
rows' steps on one MLX stream while a long prompt's chunks run on another.

    python benchmarks/prefill_overlap.py MODEL [--rows 8] [--prompt 16384] [--chunk 4096]
        [--steps 40] [--out overlap.json]

Time-sharing one stream cannot meet both of issue 43.3's targets: with a decode step of d seconds
and a prefill slice of s x c beside it, the streams' ITL ratio is 1 + s c / d and the prompt's
TTFT ratio at least 1 + d / (s c), so ITL within 2x means TTFT at least 2x. Two streams escape
that bound only if the device runs the decode step's small kernels between the prefill's large
ones. Measured here, in one process, on one model (medians and p90s over `--steps` steps):
- `decode_alone`: the gaps between decode steps (the family's compiled `forward_block`, `--rows` rows, one
  token each, and their logits), back to back;
- `prefill_alone`: a `--prompt`-token prompt in `--chunk`-token chunks through our prefill
  (`ModelForward.prefill`, its whole graph built then evaluated: `PrefillOptions(paced=False)`);
- `shared_stream`: both on the default stream, the host running decode steps back to back and,
  once a chunk's estimated time (from `prefill_alone`) has passed, the chunk's wait and the next
  chunk queued (one in flight: what time-sharing gives);
- `two_streams`: the same loop with the chunks on a stream of their own, two queued at a time
  (the device always has the next). MLX's evaluation waits for the device once more than 10
  command buffers (100 operations each on an H100/H200) are in flight, so queueing a whole chunk
  holds the host (and the decode steps) for most of the chunk's time: on the H200 of 2026-11-28 a
  4,096-token chunk took 330-430 ms to queue, ~400 ms to run;
- `layered_N`: the chunks on their own stream, queued a layer at a time through the prefill's
  per-layer hook, a decode step after every N layers (at most 2N layers queued ahead).
The ITL is the gap between decode steps' ends (the host's queueing and waits included).
Reports each mode's decode step times (median, p90, max) and the prompt's total time, with the
ratios to alone. Writes JSON (the commit, the card, every sample).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from prefill_block import block_fn, block_state, call, context_caches, positions, restore

from mlx_relay.engine.lanes.stage_forward import ModelForward
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.layers import logits


def summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"median": statistics.median(ordered), "p90": ordered[int(0.9 * (len(ordered) - 1))],
            "max": ordered[-1], "n": len(ordered)}


class Decoder:
    """`rows` decoding rows after a short context: one compiled step (tokens in, logits out)."""

    def __init__(self, lm: Any, rows: int, seed: int) -> None:
        self.lm = lm
        state = block_state(context_caches(lm, 64, 64, seed), 64)
        state.pad_to(rows)
        mx.eval(state.arrays())
        self.state = state
        self.fn = mx.compile(block_fn(lm, PrefillOptions()))
        self.rows = rows

    def step(self) -> mx.array:
        tokens = mx.random.randint(0, self.lm.args.vocab_size, (self.rows, 1))
        hidden, *_ = call(self.fn, tokens, self.state)
        return logits(self.lm, hidden)


class Prompt:
    """A long prompt's chunks, each queued whole (`paced=False`) on `stream`."""

    def __init__(self, lm: Any, saved: list[Any], prompt: int, chunk: int, seed: int) -> None:
        mx.random.seed(seed)
        self.lm, self.prompt, self.chunk = lm, prompt, chunk
        self.ids = mx.random.randint(0, lm.args.vocab_size, (1, prompt))
        mx.eval(self.ids)
        self.caches = restore(lm, saved)
        self.forward = ModelForward(lm, PrefillOptions(paced=False))
        self.done = 0
        self.queue_ms: list[float] = []  # the host's time to build and queue each chunk

    def queue(self, stream: Any) -> list[Any]:
        a, b = self.done, min(self.prompt, self.done + self.chunk)
        t0 = time.perf_counter()
        with mx.stream(stream):
            out = self.forward.prefill(self.ids[:, a:b], None, self.caches, positions(a, b))
            pending = [out[:, -1:], [c.state for c in self.caches]]
            mx.async_eval(pending)
        self.done = b
        self.queue_ms.append((time.perf_counter() - t0) * 1000)
        return pending

    @property
    def finished(self) -> bool:
        return self.done >= self.prompt


def alone_decode(decoder: Decoder, steps: int) -> list[float]:
    """The gaps between decode steps' ends (ms), back to back."""
    ends = []
    for _ in range(steps + 2):
        mx.eval(decoder.step())
        ends.append(time.perf_counter())
    return gaps(ends[1:])


def gaps(ends: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(ends)]


def alone_prefill(prompt: Prompt) -> tuple[float, list[float]]:
    mx.synchronize()
    t0 = time.perf_counter()
    chunks = []
    while not prompt.finished:
        c0 = time.perf_counter()
        mx.eval(prompt.queue(mx.default_stream(mx.default_device())))
        chunks.append((time.perf_counter() - c0) * 1000)
    return time.perf_counter() - t0, chunks


def beside(decoder: Decoder, prompt: Prompt, stream: Any, chunk_ms: float, depth: int) -> dict[str, Any]:
    """Decode steps back to back while the prompt's chunks run on `stream`, `depth` chunks queued at
    a time (each built and queued whole): the oldest is awaited once its estimated time has passed
    since the one before it was (so the wait is ~0 when the device kept up), and the next queued
    behind the others. The streams' ITL: the gaps between decode steps' ends (the host's queueing
    and waits included)."""
    mx.synchronize()
    t0 = time.perf_counter()
    ends = [t0]
    pending: list[list[Any]] = []
    while len(pending) < depth and not prompt.finished:
        pending.append(prompt.queue(stream))
    due = time.perf_counter() + chunk_ms / 1000
    waits: list[float] = []
    while pending:
        mx.eval(decoder.step())
        now = time.perf_counter()
        ends.append(now)
        if now >= due:
            mx.eval(pending.pop(0))
            waits.append((time.perf_counter() - now) * 1000)
            due = max(due, time.perf_counter() - chunk_ms / 1000) + chunk_ms / 1000
            if not prompt.finished:
                pending.append(prompt.queue(stream))
    total = time.perf_counter() - t0
    return {"prefill_s": total, "depth": depth, "decode_ms": gaps(ends), "chunk_waits_ms": waits,
            "queue_ms": prompt.queue_ms}


def layered(decoder: Decoder, prompt: Prompt, stream: Any, every: int, ahead: int) -> dict[str, Any]:
    """The prompt's chunks on `stream`, queued a layer at a time (`ModelForward.prefill`'s `after`
    hook), a decode step on the default stream after every `every` layers queued; at most `ahead`
    layers queued and not awaited (past that the oldest is awaited: the prefill is behind)."""
    mx.synchronize()
    t0 = time.perf_counter()
    ends = [t0]
    queued: list[mx.array] = []
    waits: list[float] = []
    layers = [0]
    default = mx.default_stream(mx.default_device())

    def hook(h: mx.array) -> None:
        mx.async_eval(h)
        queued.append(h)
        layers[0] += 1
        if layers[0] % every:
            return
        with mx.stream(default):
            mx.eval(decoder.step())
        ends.append(time.perf_counter())
        while len(queued) > ahead:
            w0 = time.perf_counter()
            mx.eval(queued.pop(0))
            waits.append((time.perf_counter() - w0) * 1000)
        del queued[:max(0, len(queued) - ahead)]

    while not prompt.finished:
        a, b = prompt.done, min(prompt.prompt, prompt.done + prompt.chunk)
        with mx.stream(stream):
            out = prompt.forward.prefill(prompt.ids[:, a:b], None, prompt.caches, positions(a, b), after=hook)
            mx.async_eval(out[:, -1:], [c.state for c in prompt.caches])
        prompt.done = b
    mx.eval([c.state for c in prompt.caches])
    total = time.perf_counter() - t0
    return {"prefill_s": total, "every": every, "ahead": ahead, "decode_ms": gaps(ends), "waits_ms": waits}


def main() -> None:
    from prefill_parts import card, commit  # beside this script (benchmarks/)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", default="1,2,4", help="layered modes: a decode step after every N layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = load_model(args.model).model.language_model
    default, second = mx.default_stream(mx.default_device()), mx.new_stream(mx.default_device())
    saved = [c.state for c in lm.make_cache()]
    decoder = Decoder(lm, args.rows, args.seed)
    report: dict[str, Any] = {"commit": commit(), "card": card(), "model": str(args.model), "rows": args.rows,
                              "prompt": args.prompt, "chunk": args.chunk}
    alone_prefill(Prompt(lm, saved, args.chunk, args.chunk, args.seed))  # this chunk shape's kernels
    decode = alone_decode(decoder, args.steps)
    prefill_s, chunks = alone_prefill(Prompt(lm, saved, args.prompt, args.chunk, args.seed))
    chunk_ms = statistics.median(chunks)
    report["decode_alone"] = {"ms": decode, **summary(decode)}
    report["prefill_alone"] = {"s": prefill_s, "chunk_ms": chunks}
    print(f"decode alone: ITL {({k: round(v, 1) for k, v in summary(decode).items()})}; "
          f"prefill alone {prefill_s:.2f} s (chunks {[round(c) for c in chunks]})", flush=True)
    modes: dict[str, Any] = {
        "shared_stream": lambda: beside(decoder, Prompt(lm, saved, args.prompt, args.chunk, args.seed),
                                        default, chunk_ms, 1),
        "two_streams": lambda: beside(decoder, Prompt(lm, saved, args.prompt, args.chunk, args.seed),
                                      second, chunk_ms, 2)}
    for every in (int(e) for e in args.every.split(",")):
        modes[f"layered_{every}"] = lambda every=every: layered(
            decoder, Prompt(lm, saved, args.prompt, args.chunk, args.seed), second, every, 2 * every)
    for name, fn in modes.items():
        run = fn()
        s = summary(run["decode_ms"])
        run.update(s, itl_p90_ratio=s["p90"] / report["decode_alone"]["p90"],
                   itl_median_ratio=s["median"] / report["decode_alone"]["median"],
                   ttft_ratio=run["prefill_s"] / prefill_s)
        report[name] = run
        print(f"{name}: ITL {({k: round(v, 1) for k, v in s.items()})}; prefill {run['prefill_s']:.2f} s; "
              f"ITL p90 x{run['itl_p90_ratio']:.2f}, TTFT x{run['ttft_ratio']:.2f}; waits "
              f"{[round(w, 1) for w in run.get('chunk_waits_ms', run.get('waits_ms', []))][:12]}", flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

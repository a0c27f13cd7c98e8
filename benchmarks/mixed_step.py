"""What a step costs that decodes rows and prefills a slice of a long prompt (issue 43.3): one
forward for both (`DecodeStep.beside`, the plain lane's mixed step) against two (the decode step,
then the chunk's forward), per slice size.

    python benchmarks/mixed_step.py MODEL [--rows 8] [--context 8192] [--slices 16,64,128,256,512,1024]
        [--steps 8] [--out mixed.json]

One process, one model, the lane's own parts: `--rows` decoding rows (a `DecodeState` after a
64-token context, padded to the batch's bucket, stepped by the compiled `DecodeStep`) and a prompt
whose first `--context` tokens are in the library's caches, fed `slice` more tokens a step through
`ModelForward.prefill`'s options (paced a layer ahead on a GPU, as the lane runs it). For each
slice, `--steps` steps each way, alternating the modes step by step, every step evaluated and
synchronized (the prompt's caches grow by the slice each step, so the context is reported):
- `decode`: the decode step alone;
- `two`: the decode step, then the chunk's forward (the lane with `--no-mixed-steps`);
- `mixed`: one forward for both (the default; a small slice's layers compiled per part where the
  options say, `models/compiled_parts.py`: on a CUDA GPU up to 512 tokens);
- `eager`: the same forward with nothing compiled (the A/B of the compiled parts);
- `chunk` (for `gpu/kernel_profile.py`, not in the table): the chunk's forward alone;
- `unmerged` (`--unmerged`): `mixed` over a second copy of the model whose projections of one input
  stay separate matmuls (`models/merged_projections.py`'s other side), alternated with the others.
Reports, per slice and mode, the step's median and p90 (ms), its ratio to the decode step alone
(what a decoding stream's ITL becomes) and the prompt's rate beside the rows (tokens a second of
steps); with `--alone-chunk N` also a lone N-token chunk's rate (the prompt's rate alone: the TTFT
ratio beside is the one over the other). Writes JSON (the commit, the card, every sample).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
from bench_prefill import card, commit
from prefill_block import context_caches, positions

from mlx_relay.engine.lanes.decode_state import DecodeState, batch_bucket
from mlx_relay.engine.lanes.decode_step import DecodeStep
from mlx_relay.engine.lanes.stage_forward import ModelForward
from mlx_relay.engine.memory.batch_caches import as_batch_caches
from mlx_relay.engine.models import Chunk, family_of
from mlx_relay.engine.models.dense_copies import add_dense_copies
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.prefill_options import PrefillOptions

MODES = ("decode", "two", "mixed", "eager")


class Bench:
    def __init__(self, lm: Any, rows: int, context: int, seed: int, experts: str = "kernel",
                 min_routes: int | None = None, compiled_max: int | None = None) -> None:
        self.lm, self.rows = lm, batch_bucket(rows)
        self.step = DecodeStep(lm)
        options = PrefillOptions().with_experts(experts)  # type: ignore[arg-type]
        if min_routes is not None:
            options = msgspec.structs.replace(options, grouped_min_routes=min_routes)
        options = msgspec.structs.replace(options, compiled_max_tokens=compiled_max)
        self.forward = ModelForward(lm, options)
        state = DecodeState.from_batch_caches(as_batch_caches(context_caches(lm, 64, 64, seed)), [0])
        state.pad_to(self.rows)
        self.state = state
        self.tokens = mx.zeros((self.rows,), dtype=mx.int32)
        self.caches = as_batch_caches(context_caches(lm, context, 2048, seed + 1))
        self.done = context
        mx.eval(state.arrays(), [c.state for c in self.caches])

    def chunk(self, n: int) -> Chunk:
        ids = mx.random.randint(0, self.lm.args.vocab_size, (1, n)).astype(mx.int32)
        chunk = Chunk(ids, None, self.caches, positions(self.done, self.done + n))
        self.done += n
        return chunk

    def run(self, mode: str, n: int) -> float:
        """One step of `mode` with an `n`-token slice: its milliseconds, evaluated and synchronized."""
        mx.synchronize()
        t0 = time.perf_counter()
        if mode in ("mixed", "eager"):
            parts = self.forward.parts if mode == "mixed" else None
            hidden, logits = self.step.beside(self.chunk(n), self.tokens, self.state, self.forward.options, parts)
            out = [hidden[:, -1:], logits]
        elif mode == "chunk":  # the chunk's forward alone (no rows decoding)
            chunk = self.chunk(n)
            logits = None
            out = [self.forward.prefill(chunk.ids, None, chunk.caches, chunk.positions)[:, -1:]]
        else:
            logits = self.step(self.tokens, self.state)
            out = [logits]
            if mode == "two":
                mx.async_eval(logits)
                chunk = self.chunk(n)
                out.append(self.forward.prefill(chunk.ids, None, chunk.caches, chunk.positions)[:, -1:])
        if logits is not None:
            self.tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(out, self.tokens, self.state.arrays(), [c.state for c in self.caches])
        mx.synchronize()
        return (time.perf_counter() - t0) * 1000


def lone_chunk_rate(bench: Bench, n: int, repeats: int) -> float:
    """A lone `n`-token chunk's tokens a second (the prompt's rate with no rows decoding)."""
    times = []
    for _ in range(repeats):
        chunk = bench.chunk(n)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(bench.forward.prefill(chunk.ids, None, chunk.caches, chunk.positions)[:, -1:],
                [c.state for c in bench.caches])
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def measure(runs: dict[str, tuple[Bench, str]], slices: list[int], steps: int) -> dict[str, Any]:
    """`runs`: each reported mode, the bench and the mode it runs."""
    # warm: every shape once (compiles, plans), its time kept: a shape's first step is what a
    # server meets that never ran it
    first = {(mode, n): b.run(m, n) for mode, (b, m) in runs.items() for n in slices}
    out: dict[str, Any] = {}
    for n in slices:
        context = runs["decode"][0].done
        samples: dict[str, list[float]] = {m: [] for m in runs}
        for _ in range(steps):
            for mode, (b, m) in runs.items():
                samples[mode].append(b.run(m, n))
        decode = statistics.median(samples["decode"])
        out[str(n)] = {"context": context, "samples_ms": samples,
                       "first_ms": {mode: first[mode, n] for mode in runs}, **{
            mode: {"median_ms": statistics.median(v), "p90_ms": sorted(v)[int(0.9 * (len(v) - 1))],
                   "itl_ratio": statistics.median(v) / decode,
                   "prompt_tok_s": n / (statistics.median(v) / 1000) if mode != "decode" else 0.0}
            for mode, v in samples.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--slices", default="16,64,128,256,512,1024")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--alone-chunk", type=int, default=0, help="also time lone chunks of this many tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default="kernel", choices=("kernel", "narrow", "dequantize", "library"),
                    help="the chunk's routed experts (the server's --prefill-experts)")
    ap.add_argument("--min-routes", type=int, default=None,
                    help="(token, expert) pairs from which the experts run grouped (PrefillOptions.grouped_min_routes)")
    ap.add_argument("--dense-16bit", action="store_true", help="16-bit copies of the dense projections (--dense-16bit)")
    ap.add_argument("--compiled-max", type=int, default=None,
                    help="the largest slice whose layers run compiled per part (default: 512 on CUDA, else 0)")
    ap.add_argument("--unmerged", action="store_true",
                    help="also the mixed step over a second, unmerged copy of the model (models/merged_projections.py)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lm = load_model(Path(args.model)).model.language_model
    if args.dense_16bit:
        print(f"16-bit dense copies: {add_dense_copies(family_of(lm).layers(lm)) / 1e9:.2f} GB")
    bench = Bench(lm, args.rows, args.context, args.seed, args.experts, args.min_routes, args.compiled_max)
    runs = {m: (bench, m) for m in MODES}
    if args.unmerged:
        other = load_model(Path(args.model), merge=False).model.language_model
        runs["unmerged"] = (Bench(other, args.rows, args.context, args.seed, args.experts, args.min_routes,
                                  args.compiled_max), "mixed")
    slices = [int(s) for s in args.slices.split(",")]
    result = measure(runs, slices, args.steps)
    alone = lone_chunk_rate(bench, args.alone_chunk, 3) if args.alone_chunk else None
    print(f"{bench.rows} decoding rows, prompt context {args.context}+; ms a step (median), ITL ratio to decode alone")
    print(f"{'slice':>6} {'decode':>8} {'two':>8} {'mixed':>8} {'eager':>8} {'two x':>6} {'mixed x':>7} "
          f"{'two tok/s':>9} {'mixed tok/s':>11}" + (" mixed TTFT x" if alone else ""))
    for n, r in result.items():
        line = (f"{n:>6} {r['decode']['median_ms']:8.1f} {r['two']['median_ms']:8.1f} {r['mixed']['median_ms']:8.1f} "
                f"{r['eager']['median_ms']:8.1f} {r['two']['itl_ratio']:6.2f} {r['mixed']['itl_ratio']:7.2f} "
                f"{r['two']['prompt_tok_s']:9.0f} {r['mixed']['prompt_tok_s']:11.0f}")
        print(line + (f" {alone / r['mixed']['prompt_tok_s']:12.2f}" if alone else "")
              + (f"  unmerged {r['unmerged']['median_ms']:.1f}" if args.unmerged else ""))
    print("first step of each shape (ms): " + "; ".join(
        f"{n}: " + " ".join(f"{m} {r['first_ms'][m]:.0f}" for m in runs) for n, r in result.items()))
    if alone:
        print(f"lone {args.alone_chunk}-token chunk: {alone:.0f} tok/s")
    if args.out:
        args.out.write_text(json.dumps({"commit": commit(), "card": card()[0], "rows": bench.rows,
                                        "context": args.context, "alone_chunk": args.alone_chunk,
                                        "alone_tok_s": alone, "slices": result}, indent=1))


if __name__ == "__main__":
    main()

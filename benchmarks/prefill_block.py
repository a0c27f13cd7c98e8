"""What a small prefill chunk costs through a compiled block forward (issue 43.3), beside our prefill
forward: the lever for a step that carries a slice of prefill beside decoding rows.

    python benchmarks/prefill_block.py MODEL [--chunks 16,64,256,1024] [--context 28672] [--repeats 5]
        [--check] [--out block.json]

A prefill chunk of T tokens after C tokens of context, timed (medians over `--repeats`, each
evaluated and synchronized around the timed call) three ways:
- `ours`: `ModelForward.prefill` over the library's caches (what the lanes run: built in Python
  each chunk, queued a layer ahead on a GPU);
- `block_eager` / `block_compiled`: the family's `forward_block` (the decode step's and the MTP
  verify's layer loop over explicit caches: keys and values written into fixed buffers at columns
  [C, C + T) and read under a causal mask, the GatedDeltaNet window and state in and out) over the
  same state, eagerly and through `mx.compile` (one trace per chunk length and buffer size, as the
  decode step), its experts as a prefill chunk's (`PrefillOptions`);
- and the decode step's own cost (T = 1, compiled) for scale.
On the H200 of 2026-11-28 a 256-token chunk cost 74-88 ms through `ours` where a decode step of 8
rows costs ~21 ms (`benchmarks/results/prefill-h200-2026-11-28/`): if the compiled block is much
cheaper, a step can carry a prefill slice beside the decoding rows within a small factor of their
step. `--check` first compares the block's hidden states with ours (run it on a float32 fixture on
the CPU: they must agree to float32 rounding). Writes JSON (the commit, the card, every sample).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay.engine.lanes.decode_state import DecodeState
from mlx_relay.engine.lanes.stage_forward import ModelForward
from mlx_relay.engine.memory.batch_caches import as_batch_caches
from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.layers import logits

BlockFn = Callable[..., tuple[mx.array, Any, Any, Any]]


def positions(a: int, b: int) -> mx.array:
    return mx.broadcast_to(mx.arange(a, b, dtype=mx.int32)[None, None, :], (3, 1, b - a))


def context_caches(lm: Any, context: int, chunk: int, seed: int) -> list[Any]:
    """The library's caches after `context` random tokens, prefilled through our forward."""
    mx.random.seed(seed)
    caches = lm.make_cache()
    forward = ModelForward(lm, PrefillOptions())
    for a in range(0, context, chunk):
        b = min(context, a + chunk)
        ids = mx.random.randint(0, lm.args.vocab_size, (1, b - a))
        mx.eval(forward.prefill(ids, None, caches, positions(a, b)), [c.state for c in caches])
    return caches


def block_fn(lm: Any, options: PrefillOptions) -> BlockFn:
    """(tokens [B, T], idx, left_padding, deltas, kv, conv, ssm) -> (hidden [B, T, H], kv, conv, ssm):
    T positions per row written at columns [idx, idx + T), each attending to the columns up to its own."""
    family = family_of(lm)

    def run(tokens: mx.array, idx: mx.array, left_padding: mx.array, deltas: mx.array, kv: Any, conv: Any,
            ssm: Any) -> tuple[mx.array, Any, Any, Any]:
        B, T = tokens.shape
        offsets = idx - left_padding + deltas
        rotary = mx.broadcast_to((offsets[:, None] + mx.arange(T, dtype=mx.int32)[None, :])[None], (3, B, T))
        columns = mx.arange(kv[0][0].shape[2])
        last = idx + mx.arange(T)
        valid = ((columns[None, None, :] >= left_padding[:, None, None])
                 & (columns[None, None, :] <= last[None, :, None]))
        at = Positions.at_column(idx, rotary, valid[:, None], offsets)
        return family.forward_block(lm, tokens, at, kv, conv, ssm, keep_states=False, stage=None, prefill=options)

    return run


def block_state(caches: list[Any], room: int) -> DecodeState:
    """The caches as one row's explicit state, with room for `room` more columns."""
    state = DecodeState.from_batch_caches(as_batch_caches(caches), [0])
    state.ensure_room(room)
    mx.eval(state.arrays())
    return state


def call(fn: BlockFn, tokens: mx.array, state: DecodeState) -> tuple[mx.array, Any, Any, Any]:
    return fn(tokens, mx.array(state.idx, dtype=mx.int32), state.left_padding, state.deltas, state.kv, state.conv,
              state.ssm)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats + 1):  # the first run compiles this shape's kernels (and traces): dropped
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append((time.perf_counter() - t0) * 1000)
    return out[1:]


def restore(lm: Any, saved: list[Any]) -> list[Any]:
    """Fresh caches holding `saved` (copies: the caches update their arrays and lists in place)."""
    caches = lm.make_cache()
    for c, s in zip(caches, saved, strict=True):
        if s is not None and not (isinstance(s, (list, tuple)) and all(x is None for x in s)):
            c.state = [None if x is None else mx.array(x) for x in s]
    return caches


def check(lm: Any, caches: list[Any], context: int, chunk: int, *, compiled: bool = False) -> float:
    """max |block - ours| / max |ours| of the chunk's final hidden states (and the next token's
    logits), the block eager or compiled (`tests/test_prefill_block.py` pins it, float32)."""
    saved = [c.state for c in caches]
    ids = mx.random.randint(0, lm.args.vocab_size, (1, chunk))
    ours = ModelForward(lm, PrefillOptions()).prefill(ids, None, restore(lm, saved),
                                                      positions(context, context + chunk))
    state = block_state(restore(lm, saved), chunk)
    fn = block_fn(lm, PrefillOptions())
    block, *_ = call(mx.compile(fn) if compiled else fn, ids, state)
    diffs = [mx.abs(block - ours).max() / mx.maximum(mx.abs(ours).max(), 1e-6),
             mx.abs(logits(lm, block) - logits(lm, ours)).max() / mx.abs(logits(lm, ours)).max()]
    return float(max(d.item() for d in diffs))


def measure(lm: Any, context: int, chunks: list[int], repeats: int, seed: int) -> dict[str, Any]:
    context = max(context, 1)  # (explicit caches start from a prefilled token: context 0 runs as 1)
    caches = context_caches(lm, context, max(chunks), seed)
    saved = [c.state for c in caches]
    out: dict[str, Any] = {"context": context, "ms": {}}
    eager, compiled = block_fn(lm, PrefillOptions()), mx.compile(block_fn(lm, PrefillOptions()))
    for T in [1, *chunks]:
        ids = mx.random.randint(0, lm.args.vocab_size, (1, T))
        state = block_state(restore(lm, saved), T)  # the block's inputs are left as they are: reused
        mx.eval(ids)
        row: dict[str, list[float]] = {}
        if T > 1:
            pos = positions(context, context + T)
            row["ours"] = timed(lambda ids=ids, pos=pos: ModelForward(lm, PrefillOptions()).prefill(
                ids, None, restore(lm, saved), pos), repeats)
            row["block_eager"] = timed(lambda ids=ids, state=state: call(eager, ids, state)[0], repeats)
        row["block_compiled"] = timed(lambda ids=ids, state=state: call(compiled, ids, state)[0], repeats)
        out["ms"][str(T)] = row
        print(f"context {context}, T {T}: " + ", ".join(
            f"{k} {statistics.median(v):.2f} ms" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    from prefill_parts import card, commit  # beside this script (benchmarks/)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--chunks", default="16,64,256,1024")
    parser.add_argument("--context", default="28672")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="first compare the block with ours (float32 fixtures)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = load_model(args.model).model.language_model
    chunks = [int(c) for c in args.chunks.split(",")]
    report: dict[str, Any] = {"commit": commit(), "card": card(), "model": str(args.model), "runs": []}
    if args.check:
        caches = context_caches(lm, 40, 16, args.seed)
        report["check_rel"] = {str(T): check(lm, caches, 40, T) for T in chunks}
        print(f"check (block against ours, max relative): {report['check_rel']}", flush=True)
    for context in (int(c) for c in args.context.split(",")):
        report["runs"].append(measure(lm, context, chunks, args.repeats, args.seed))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Issue 43.3's next lever, measured before it is built: a mixed step whose prefill chunk keeps
explicit buffers too, as the decoding rows' do (its attention keys and values in buffers of a
fixed capacity, written at the chunk's column; its GatedDeltaNet conv window and recurrent state
as arrays), so the whole step has one shape per (chunk length, rows, capacity) and runs as ONE
compiled function, against the engine's mixed step today (the chunk over the library's caches,
run eagerly: `DecodeStep.beside`) and the compiled decode step alone.

    python benchmarks/mixed_explicit.py MODEL [--rows 8] [--context 4096] [--slices 16,64,256] [--steps 8]

A Qwen3.5-family model. In one process: `--rows` decoding rows (the lane's `DecodeState`) and a
prompt whose first `--context` tokens are prefilled (the library's caches for the engine's mixed
step; the same state copied into explicit buffers of the prompt's whole length for the others).
First a check: one step of each mixed mode from the same state, the chunk's last hidden state and
the rows' logits compared (max abs difference; float32 on the CPU, where they agree to rounding).
Then per slice, `--steps` steps of each mode, alternated, each synchronized: `decode` (the compiled
step alone), `mixed` (the engine's), `explicit` (this forward, eager), `compiled` (this forward
through `mx.compile`; its first step per shape traces it) and `compiled_rec` (the same, the chunk's
GatedDeltaNet run by the decode step's recurrent mixer over its T positions instead of the prefill's
chunked delta rule). On the CPU the check is what counts (there the chunked path agrees with the
engine's mixed step exactly, float32; the recurrent one to rounding, and its fallback runs a block
position by position where the CUDA kernel runs it in one launch).

What the numbers decide: if `compiled` beside 8 rows stays within 2x of `decode` at a slice that
keeps the prompt near its own rate (issue 43.3's targets), the engine's prefilling rows move into
explicit buffers (a prompt's keys and values in the decode state's kind of buffer from its first
chunk, its snapshots read from them) and its mixed step compiles; if not, the chunk's own path is
the cost and compiling the step does not pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from bench_prefill import card, commit
from mlx_vlm.models.cache import ArraysCache, KVCache
from prefill_block import context_caches, positions

from mlx_relay.engine.lanes.decode_state import DecodeState, batch_bucket
from mlx_relay.engine.lanes.decode_step import DecodeStep, _at
from mlx_relay.engine.memory.batch_caches import as_batch_caches
from mlx_relay.engine.models import Chunk
from mlx_relay.engine.models.chunk_forward import Split
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.chunk_mixer import depthwise_conv
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import gated_delta_mixer, normalize_qk
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_prefill import delta_rule
from mlx_relay.engine.models.qwen3_5.layers import (
    attend_explicit,
    gated,
    gdn_projections,
    logits,
    qkv_heads,
    qkv_projections,
    rope_periods,
    run_layers,
)

MODES = ("decode", "mixed", "explicit", "compiled", "compiled_rec")
State = tuple[list[tuple[mx.array, mx.array]], list[mx.array], list[mx.array]]


def explicit_state(caches: list[Any], capacity: int) -> State:
    """The library's batch-1 caches as explicit buffers: keys and values [1, heads, capacity, D] per
    attention layer (the cached columns first), conv window and state per GatedDeltaNet layer."""
    kv, conv, ssm = [], [], []
    for c in caches:
        if isinstance(c, KVCache):
            keys, values = c.state
            pad = [(0, 0), (0, 0), (0, capacity - keys.shape[2]), (0, 0)]
            kv.append((mx.pad(keys, pad), mx.pad(values, pad)))
        else:
            assert isinstance(c, ArraysCache), type(c)
            conv.append(c.state[0])
            ssm.append(c.state[1])
    return kv, conv, ssm


def chunk_positions(done: mx.array, n: int, capacity: int) -> Positions:
    """A chunk of `n` text positions from `done` (a scalar array), written at column `done` of its
    buffers and attending causally to every column before it."""
    t = done + mx.arange(n, dtype=mx.int32)
    rotary = mx.broadcast_to(t[None, None, :], (3, 1, n))
    mask = (mx.arange(capacity)[None, :] <= t[:, None])[None, None]
    return Positions.at_column(done, rotary, mask, done.reshape(1))


def chunk_mixer(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv: mx.array, ssm: mx.array
                ) -> tuple[mx.array, mx.array, mx.array]:
    """A chunk's GatedDeltaNet between its projections as the engine's prefill runs it
    (`chunk_mixer.gated_delta_core`: the depthwise conv, the chunked delta rule), its conv window and
    recurrent state explicit: the output [B, T, Hv * Dv] and both states after."""
    B, T, _ = qkv.shape
    width = la.conv_kernel_size - 1
    conv_in = mx.concatenate([conv, qkv], axis=1)
    mixed = nn.silu(depthwise_conv(la, conv_in, T))
    q, k, v = (x.reshape(B, T, heads, dim) for x, heads, dim in zip(
        mx.split(mixed, [la.key_dim, 2 * la.key_dim], -1), (la.num_k_heads, la.num_k_heads, la.num_v_heads),
        (la.head_k_dim, la.head_k_dim, la.head_v_dim), strict=True))
    q, k = normalize_qk(q, k)
    y, state = delta_rule(q, k, v, a, b, la.A_log, la.dt_bias, ssm)
    out = la.norm(y, z.reshape(B, T, -1, la.head_v_dim))
    return out.reshape(B, T, -1), conv_in[:, -width:], state


def explicit_forward(lm: Any, ids: mx.array, done: mx.array, chunk: State, tokens: mx.array, rows_at: Positions,
                     rows: State, options: PrefillOptions, chunked: bool = True
                     ) -> tuple[mx.array, mx.array, State, State]:
    """The chunk's last hidden state, the rows' logits, and both states after: the joined positions
    through every shared part, each mixer split by part, every cache explicit."""
    model = lm.model
    h_chunk, h_rows = model.embed_tokens(ids), model.embed_tokens(tokens[:, None])
    split = Split.of(h_chunk, h_rows)
    capacity = chunk[0][0][0].shape[2]
    at = {"chunk": chunk_positions(done, ids.shape[1], capacity), "rows": rows_at}
    periods = rope_periods(model.layers)
    kv_in = {"chunk": iter(chunk[0]), "rows": iter(rows[0])}
    gdn_in = {"chunk": iter(zip(chunk[1], chunk[2], strict=True)), "rows": iter(zip(rows[1], rows[2], strict=True))}
    out: dict[str, State] = {"chunk": ([], [], []), "rows": ([], [], [])}

    def linear(la: Any, x: mx.array) -> mx.array:
        parts = []
        for part, projections in zip(("chunk", "rows"), zip(*(split.split(p) for p in gdn_projections(la, x)),
                                                             strict=True), strict=True):
            conv, ssm = next(gdn_in[part])
            if part == "chunk" and chunked:
                r, conv, ssm = chunk_mixer(la, *projections, conv, ssm)
            else:
                r, conv, ssm = gated_delta_mixer(la, *projections, conv, ssm, keep_states=False)
            out[part][1].append(conv)
            out[part][2].append(ssm)
            parts.append(r)
        return la.out_proj(split.join(*parts))

    def attend(sa: Any, x: mx.array) -> mx.array:
        parts = []
        for part, projections in zip(("chunk", "rows"), zip(*(split.split(p) for p in qkv_projections(sa, x)),
                                                             strict=True), strict=True):
            q, k, v, gate = qkv_heads(sa, *projections)
            keys, values = next(kv_in[part])
            o, keys, values = attend_explicit(sa, q, k, v, keys, values, at[part], periods)
            out[part][0].append((keys, values))
            parts.append(gated(o, gate))
        return sa.o_proj(split.join(*parts))

    h = run_layers(model.layers, split.join(h_chunk, h_rows), linear, attend, prefill=options)
    hidden_chunk, hidden_rows = split.split(model.norm(h))
    return hidden_chunk[:, -1:], logits(lm, hidden_rows)[:, -1, :], out["chunk"], out["rows"]


class Bench:
    def __init__(self, lm: Any, rows: int, context: int, capacity: int, seed: int) -> None:
        self.lm, self.rows, self.capacity = lm, batch_bucket(rows), capacity
        self.step = DecodeStep(lm)
        self.options = PrefillOptions()
        self.state = DecodeState.from_batch_caches(as_batch_caches(context_caches(lm, 64, 64, seed)), [0])
        self.state.pad_to(self.rows)
        library = context_caches(lm, context, 2048, seed + 1)
        self.chunk_state = explicit_state(library, capacity)
        self.caches = as_batch_caches(library)
        self.tokens = mx.zeros((self.rows,), dtype=mx.int32)
        self.done = context
        self.compiled = mx.compile(self._explicit)
        self.compiled_rec = mx.compile(lambda *a: self._explicit(*a, chunked=False))
        mx.eval(self.state.arrays(), [c.state for c in self.caches], self.chunk_state)

    def _explicit(self, ids: mx.array, done: mx.array, chunk: State, tokens: mx.array, idx: mx.array,
                  left_padding: mx.array, deltas: mx.array, rows: State, chunked: bool = True) -> tuple[Any, ...]:
        at = _at(idx, left_padding, deltas, rows[0][0][0].shape[2])
        return explicit_forward(self.lm, ids, done, chunk, tokens, at, rows, self.options, chunked)

    def outputs(self, mode: str, n: int) -> list[Any]:
        """One step of `mode` with an `n`-token slice (unevaluated), the states updated."""
        ids = mx.random.randint(0, self.lm.args.vocab_size, (1, n)).astype(mx.int32)
        st = self.state
        if mode == "decode":
            return [self.step(self.tokens, st)]
        if mode == "mixed":
            chunk = Chunk(ids, None, self.caches, positions(self.done, self.done + n))
            hidden, lg = self.step.beside(chunk, self.tokens, st, self.options)
            self.done += n
            return [hidden[:, -1:], lg, [c.state for c in self.caches]]
        st.ensure_room()
        args = (ids, mx.array(self.done, dtype=mx.int32), self.chunk_state, self.tokens, mx.array(st.idx, mx.int32),
                st.left_padding, st.deltas, (st.kv, st.conv, st.ssm))
        fn = {"compiled": self.compiled, "compiled_rec": self.compiled_rec}.get(mode, self._explicit)
        hidden, lg, self.chunk_state, (st.kv, st.conv, st.ssm) = fn(*args)
        st.idx += 1
        self.done += n
        return [hidden, lg, self.chunk_state]

    def run(self, mode: str, n: int) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        out = self.outputs(mode, n)
        lg = out[1] if mode != "decode" else out[0]
        self.tokens = mx.argmax(lg, axis=-1).astype(mx.int32)
        mx.eval(out, self.tokens, self.state.arrays())
        mx.synchronize()
        return (time.perf_counter() - t0) * 1000


def check(lm: Any, args: argparse.Namespace, n: int) -> dict[str, float]:
    """One step of each mixed mode from the same state: their chunk's last
    hidden state and rows' logits against `mixed`'s (max abs difference)."""
    outs = {}
    for mode in ("mixed", "explicit", "compiled", "compiled_rec"):
        mx.random.seed(args.seed + 7)
        bench = Bench(lm, args.rows, args.context, args.capacity, args.seed)
        mx.random.seed(args.seed + 11)
        out = bench.outputs(mode, n)
        mx.eval(out[:2])
        outs[mode] = out[:2]
    return {f"{mode} {what}": float(mx.max(mx.abs(outs[mode][i].astype(mx.float32)
                                                  - outs["mixed"][i].astype(mx.float32))).item())
            for mode in ("explicit", "compiled", "compiled_rec") for i, what in enumerate(("hidden", "logits"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--slices", default="16,64,256")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=0, help="the chunk's buffers (default: all the steps fit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    slices = [int(s) for s in args.slices.split(",")]
    need = args.context + sum(slices) * (args.steps * len(MODES) + 2) + max(slices)
    args.capacity = args.capacity or -(-need // 1024) * 1024
    lm = load_model(Path(args.model)).model.language_model
    diffs = check(lm, args, slices[0])
    print("check against the engine's mixed step (max abs difference): "
          + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    bench = Bench(lm, args.rows, args.context, args.capacity, args.seed)
    first = {(mode, n): bench.run(mode, n) for n in slices for mode in MODES}
    result: dict[str, Any] = {}
    for n in slices:
        samples: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(args.steps):
            for mode in MODES:
                samples[mode].append(bench.run(mode, n))
        med = {m: statistics.median(v) for m, v in samples.items()}
        result[str(n)] = {"median_ms": med, "samples_ms": samples, "first_ms": {m: first[m, n] for m in MODES},
                          "itl_ratio": {m: med[m] / med["decode"] for m in MODES}}
    print(f"{bench.rows} decoding rows beside a prompt {args.context}+ tokens in (buffers of {args.capacity}); "
          "ms a step (median), x the decode step")
    print(f"{'slice':>6} " + " ".join(f"{m:>16}" for m in MODES))
    for n, r in result.items():
        print(f"{n:>6} " + " ".join(f"{r['median_ms'][m]:8.1f} ({r['itl_ratio'][m]:4.2f}x)" for m in MODES))
    print("first step of each shape (ms): " + "; ".join(
        f"{n}: " + " ".join(f"{m} {r['first_ms'][m]:.0f}" for m in MODES) for n, r in result.items()))
    if args.out:
        args.out.write_text(json.dumps({"commit": commit(), "card": card()[0], "rows": bench.rows,
                                        "context": args.context, "capacity": args.capacity, "check": diffs,
                                        "slices": result}, indent=1))


if __name__ == "__main__":
    main()

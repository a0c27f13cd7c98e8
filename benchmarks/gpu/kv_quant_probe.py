"""The quantized KV cache at long context (issue 47.2): device memory and the compiled decode step's
time for rows whose caches hold `--context` tokens each, unquantized against 8 and 4 bits.

    python benchmarks/gpu/kv_quant_probe.py MODEL [--context 131072] [--rows 1,16] [--bits none,8,4]
        [--steps 16] [--out kv_quant_probe.json]

For each (bits, rows): one real row is prefilled with a token (its recurrent states, its layout),
then every attention layer's keys and values are `--context` columns of random values (quantized as
the engine keeps them: `models.kv_quant`), the recurrent states repeated per row, as the decode batch
holds rows that far into their sessions (`lanes.decode_state.DecodeState`). Reported: the KV buffers'
bytes (MLX's active memory before and after building them, and as counted), the steps' peak (and
what the steps add over the active memory: the attention's working copies) apart from the build's, and
the compiled decode step's median over `--steps` steps after a warm-up step (every row attending to
its whole context). The weights' values do not matter to either measure. Runs anywhere MLX does
(`--context 4096` on the tiny fixture for a dry run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay.bench.machine import source_commit
from mlx_relay.engine.lanes.decode_state import DecodeState
from mlx_relay.engine.lanes.decode_step import DecodeStep
from mlx_relay.engine.memory.batch_caches import as_batch_caches
from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import first, fresh_caches, head_dim, nbytes, quantize
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.prefill_options import PrefillOptions


def long_state(lm: Any, rows: int, context: int, quant: KVQuant | None) -> DecodeState:
    """`rows` rows with `context` tokens of random keys and values in every attention layer."""
    family = family_of(lm)
    caches = fresh_caches(lm, family.make_caches(lm), quant)
    family.prefill_forward(lm, mx.array([[1]]), None, caches, mx.zeros((3, 1, 1), dtype=mx.int32), PrefillOptions())
    one = DecodeState.from_batch_caches(as_batch_caches(caches), [0])
    cap = context + 256
    D = head_dim(lm)
    kv = []
    for keys, _values in one.kv:
        # the model's own dtype for keys (a quantized buffer's scales carry it)
        heads, dtype = first(keys).shape[1], (keys[1] if isinstance(keys, tuple) else keys).dtype
        pair = []
        for _ in range(2):
            parts = []
            for _row in range(rows):  # a row at a time: the float draws stay small
                x = mx.random.normal((1, heads, cap, D)).astype(dtype)
                parts.append(x if quant is None else quantize(x, KVQuant.group_for(D), quant.bits))
                mx.eval(parts[-1])
            buf: Any = (mx.concatenate(parts) if quant is None
                        else tuple(mx.concatenate([p[i] for p in parts]) for i in range(3)))
            mx.eval(buf)
            pair.append(buf)
        kv.append((pair[0], pair[1]))
    state = DecodeState(kv, [mx.repeat(c, rows, axis=0) for c in one.conv],
                        [mx.repeat(s, rows, axis=0) for s in one.ssm], context, mx.zeros((rows,), dtype=mx.int32),
                        mx.zeros((rows,), dtype=mx.int32), one.layout,
                        None if quant is None else (KVQuant.group_for(D), quant.bits))
    mx.eval(state.arrays())
    return state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--bits", default="none,8,4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lm = load_model(args.model).model.language_model
    step = DecodeStep(lm)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for b in args.bits.split(","):
            quant = None if b == "none" else KVQuant(int(b))
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            state = long_state(lm, rows, args.context, quant)
            kv_bytes = sum(nbytes(k) + nbytes(v) for k, v in state.kv)
            after = mx.get_active_memory()
            build_peak = mx.get_peak_memory()
            mx.reset_peak_memory()  # the steps' own peak from here: what serving these rows needs
            tokens = mx.zeros((rows,), dtype=mx.int32)
            mx.eval(step(tokens, state))  # traces and compiles this shape
            times = []
            for _ in range(args.steps):
                tic = time.perf_counter()
                tokens = mx.argmax(step(tokens, state), axis=-1).astype(mx.int32)
                mx.eval(tokens)
                times.append((time.perf_counter() - tic) * 1e3)
            row = {"rows": rows, "kv_bits": b, "context": args.context, "kv_gb": round(kv_bytes / 1e9, 3),
                   "active_delta_gb": round((after - before) / 1e9, 3),
                   "peak_gb": round(mx.get_peak_memory() / 1e9, 3), "build_peak_gb": round(build_peak / 1e9, 3),
                   "step_transient_gb": round((mx.get_peak_memory() - after) / 1e9, 3),
                   "step_ms": round(statistics.median(times), 2), "step_ms_min": round(min(times), 2),
                   "step_ms_max": round(max(times), 2)}
            results.append(row)
            print(json.dumps(row), flush=True)
            del state, tokens
    base = {r["rows"]: r for r in results if r["kv_bits"] == "none"}
    for r in results:
        if r["rows"] in base and r["kv_bits"] != "none":
            r["kv_vs_none"] = round(r["kv_gb"] / base[r["rows"]]["kv_gb"], 3)
            r["step_vs_none"] = round(r["step_ms"] / base[r["rows"]]["step_ms"], 3)
    if args.out:
        args.out.write_text(json.dumps({"commit": source_commit(), "model": str(args.model),
                                        "device": repr(mx.default_device()), "results": results}, indent=1))
    print("\n".join(f"rows {r['rows']} kv {r['kv_bits']}: KV {r['kv_gb']} GB"
                    + (f" ({r['kv_vs_none']}x)" if "kv_vs_none" in r else "")
                    + f", step {r['step_ms']} ms" + (f" ({r['step_vs_none']}x)" if "step_vs_none" in r else "")
                    for r in results))
    sys.exit(0)


if __name__ == "__main__":
    main()

"""The Qwen3.5 family's dense 8-bit projections (35B-A3B shape) over the row counts a mixed step and a
prefill chunk bring (issue 43.3: a 16- to 256-token slice beside 8 decoding rows runs its dense
projections through MLX's `qmm_sm80` at 56 us a launch, 16 ms of a 67 ms step), each path side by side:

    python benchmarks/gpu/dense_rows_bench.py [--rows 8,16,24,32,64,136,264,520,2048,4096] [--out F]

Paths: `mlx` (the layer's own `QuantizedLinear` call: `quantized_matmul`), `dequantize` (the weights
dequantized in the call, then a 16-bit matmul), `resident` (a 16-bit copy of the weights kept: the
matmul alone) and `narrow` (ours, `narrow_qmm.cuda_narrow_linear`, up to 64 rows). Device
microseconds a call (`grouped_kernels_bench.time_us`: CUPTI's summed kernel durations, median of 3),
then a step's dense total: each shape's call times the number of its projections in the 40 layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_kernels_bench import time_us

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_prefill import card, commit

from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_linear

# (N, K): projections of that shape in one forward of the 35B-A3B shape's 40 layers
SHAPES: dict[tuple[int, int], int] = {
    (8192, 2048): 40,  # the linear mixers' in_proj_qkv (30), attention's q_proj with its gate (10)
    (4096, 2048): 30,  # in_proj_z
    (32, 2048): 60,  # in_proj_b, in_proj_a
    (2048, 4096): 40,  # out_proj (30), o_proj (10)
    (512, 2048): 100,  # k_proj, v_proj (20), the shared expert's gate and up (80)
    (2048, 512): 40,  # the shared expert's down
    (256, 2048): 40,  # the router
    (1, 2048): 40,  # the shared expert's gate
}


def dequantized(lin: nn.QuantizedLinear, x: mx.array) -> mx.array:
    w = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=lin.group_size, bits=lin.bits)
    return x @ w.T


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,16,24,32,64,136,264,520,2048,4096")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    mx.random.seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    paths = ("mlx", "dequantize", "resident", "narrow")
    results = []
    totals = {r: dict.fromkeys(paths, 0.0) for r in rows}
    print(f"{'rows':>5} {'N x K':>11} " + " ".join(f"{p:>10}" for p in paths) + "   (device us a call)")
    for (N, K), count in SHAPES.items():
        lin = nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), group_size=64, bits=8)
        lin.update({"scales": lin.scales.astype(mx.bfloat16), "biases": lin.biases.astype(mx.bfloat16)})
        w16 = mx.dequantize(lin.weight, lin.scales, lin.biases, group_size=64, bits=8)
        mx.eval(lin.parameters(), w16)
        for M in rows:
            x = mx.random.normal((1, M, K)).astype(mx.bfloat16)
            mx.eval(x)
            calls: dict[str, Any] = {"mlx": partial(lin, x), "dequantize": partial(dequantized, lin, x),
                                     "resident": partial(lambda a, b: a @ b.T, x, w16)}
            if M <= 64 and N % 16 == 0 and K % 256 == 0:
                calls["narrow"] = partial(cuda_narrow_linear, x, lin.weight, lin.scales, lin.biases, split_k=4)
            us = {}
            for path in paths:
                try:
                    us[path] = time_us(calls[path], args.repeats) if path in calls else float("nan")
                except Exception as exc:  # a path that fails to run is reported, the others still run
                    us[path] = float("nan")
                    print(f"  {path} failed: {exc!r}"[:300])
                totals[M][path] += count * us[path]
            results.append({"rows": M, "N": N, "K": K, "count": count, "us": us})
            print(f"{M:5d} {f'{N}x{K}':>11} " + " ".join(f"{us[p]:10.1f}" for p in paths), flush=True)
    print("\na step's dense projections (ms; nan where a path does not take every shape)")
    print(f"{'rows':>5} " + " ".join(f"{p:>10}" for p in paths))
    for M in rows:
        print(f"{M:5d} " + " ".join(f"{totals[M][p] / 1e3:10.2f}" for p in paths))
    if args.out:
        args.out.write_text(json.dumps({"commit": commit(), "card": card()[0], "results": results,
                                        "totals_ms": {str(m): {p: v / 1e3 for p, v in t.items()}
                                                      for m, t in totals.items()}}, indent=1))


if __name__ == "__main__":
    main()

"""One routed projection of the 35B-A3B shape's experts (8-bit, 256 experts), each path side by side,
per count of (token, expert) pairs (issue 43.3: which path runs a mixed step's or a chunk's experts):

    python benchmarks/gpu/grouped_kernels_bench.py [--routes 64,576,2112,4160,8256,16384] [--repeats 20]
        [--out grouped_kernels.json]

Paths, each over the same sorted pairs (random experts), the up projection's shape (N 512, K 2,048)
and the down projection's (N 2,048, K 512): `qmv` (`grouped_qmv`'s CUDA-core kernel), `narrow`
(`narrow_qmm`'s tensor-core kernel for few rows: `--prefill-experts narrow`), `qmm` (`grouped_qmm`'s
tensor-core kernel), `dequantize` (every expert dequantized, MLX's sorted `gather_mm`), `library`
(MLX's `gather_qmm` over the sorted pairs, what mlx-vlm's `SwitchGLU` calls from 64 pairs),
`library_unsorted` (the same unsorted: its call below 64 pairs, the decode step's) and `pair`
(`pair_qmv`'s one product a pair, the decode step's on a CUDA GPU). Each timed alone as the device
sees it: the kernels' summed durations (CUPTI through the machine's torch) over `--repeats` calls,
the median of 3 such runs, a call's microseconds (off a GPU profiler, the host's wall time with the
calls queued: on MLX's CUDA backend that is ~10-20 us an operation of the host's, more than a small
projection's kernel takes). The weights' bytes over the time give the bandwidth each reaches. Then
(`--dense`) a dense projection over few rows (the decode step's at that batch): MLX's
`quantized_matmul` against the qmv and narrow kernels given the weights as a single expert.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from experts_truth import quantized_switch
from step_recorder import by_kernel, profiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_prefill import card, commit

from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import cuda_grouped_qmm, fallback
from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmv import Shape, cuda_grouped_qmv
from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_linear, cuda_narrow_qmm
from mlx_relay.engine.models.qwen3_5.kernels.pair_qmv import cuda_pair_qmv


def library(rows: mx.array, proj: Any, experts: mx.array) -> mx.array:
    return mx.gather_qmm(rows, proj["weight"], proj["scales"], proj.get("biases"), rhs_indices=experts,
                         transpose=True, group_size=proj.group_size, bits=proj.bits, mode=proj.mode,
                         sorted_indices=True)


def library_unsorted(rows: mx.array, proj: Any, experts: mx.array) -> mx.array:
    """MLX's `gather_qmm` a pair, unsorted (mlx-vlm's `SwitchGLU` below 64 pairs: the decode step's)."""
    return mx.gather_qmm(rows, proj["weight"], proj["scales"], proj.get("biases"), rhs_indices=experts,
                         transpose=True, group_size=proj.group_size, bits=proj.bits, mode=proj.mode)


def pair(rows: mx.array, proj: Any, experts: mx.array) -> mx.array:
    """`pair_qmv`'s kernel: one product a pair (the decode step's and the MTP round's experts)."""
    return cuda_pair_qmv(rows.reshape(-1, rows.shape[-1]), proj, experts, 1)


PATHS = {"qmv": cuda_grouped_qmv, "narrow": cuda_narrow_qmm, "qmm": cuda_grouped_qmm, "dequantize": fallback,
         "library": library, "library_unsorted": library_unsorted, "pair": pair}


def time_us(fn: Any, repeats: int) -> float:
    """A call's cost as the device sees it: the summed duration of every kernel it launches (CUPTI
    through the machine's torch, `step_recorder`), median of 3 rounds of `repeats` calls; where no
    profiler is, the host's wall time a call with `repeats` queued (which on MLX's CUDA backend is
    bound by the host's ~10-20 us an operation for small projections: not the kernel's time)."""
    mx.eval(fn())  # compiles, plans
    mx.synchronize()
    runs = []
    for _ in range(3):
        prof = profiler()
        t0 = time.perf_counter()
        if prof is None:
            mx.eval([fn() for _ in range(repeats)])
            mx.synchronize()
            runs.append((time.perf_counter() - t0) / repeats * 1e6)
            continue
        with prof:
            mx.eval([fn() for _ in range(repeats)])
            mx.synchronize()
        runs.append(sum(sum(v) for v in by_kernel(prof).values()) / repeats)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routes", default="64,576,2112,4160,8256,16384")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--qmv-shapes", default="", help="also grouped_qmv's kernel split other ways: "
                    "'rows,cols,warps,cols_a_warp' each, space-separated (its `Shape`)")
    ap.add_argument("--hot", type=float, default=0.0,
                    help="also each route count with this share of its pairs routed to 16 experts (skewed routing)")
    ap.add_argument("--dense", default="1,4,8,16,32", help="also dense projections over these row counts ('' none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    mx.random.seed(0)
    switch = quantized_switch()
    paths = dict(PATHS)
    for stages in (1, 2):  # the tensor-core kernel with fewer groups in flight (default 4)
        paths[f"narrow_s{stages}"] = partial(cuda_narrow_qmm, stages=stages)
    for split in (2, 4):  # ... with its warps splitting K (for the dense projections)
        paths[f"narrow_k{split}"] = partial(cuda_narrow_qmm, split_k=split)
    for spec in args.qmv_shapes.split():
        shape = Shape(*(int(v) for v in spec.split(",")))
        paths[f"qmv{spec}"] = partial(cuda_grouped_qmv, shape=shape)
    E = switch.up_proj["weight"].shape[0]
    results = []
    print(f"{'routes':>7} {'proj':>5} " + " ".join(f"{p:>11}" for p in paths)
          + "   (device us a call; GB/s of qmv, pair)")
    cases = [(int(r), 0.0) for r in args.routes.split(",")]
    cases += [(int(r), args.hot) for r in args.routes.split(",")] if args.hot else []
    for routes, hot in cases:
        n_hot = int(routes * hot)  # that many pairs routed to 16 experts, the rest evenly
        experts = mx.sort(mx.concatenate([mx.random.randint(0, 16, (n_hot,)),
                                          mx.random.randint(0, E, (routes - n_hot,))]).astype(mx.uint32))
        for name, proj in (("up", switch.up_proj), ("down", switch.down_proj)):
            K = proj["weight"].shape[2] * 4
            rows = mx.random.normal((routes, 1, K)).astype(mx.bfloat16)
            mx.eval(rows, experts)
            us = {}
            for path, fn in paths.items():
                try:
                    us[path] = time_us(partial(fn, rows, proj, experts), args.repeats)
                except Exception as exc:  # a path that fails to run is reported, the others still run
                    us[path] = float("nan")
                    print(f"  {path} failed: {exc!r}"[:300])
            touched = len(set(experts.tolist()))
            gb = touched * proj["weight"].shape[1] * K * (1 + 4 / 64) / 1e9  # bytes + scales/biases
            results.append({"routes": routes, "hot": hot, "proj": name, "experts_touched": touched, "us": us,
                            "weight_gb": gb})
            print(f"{routes:7d}{'h' if hot else ' '}{name:>5} " + " ".join(f"{us[p]:11.1f}" for p in paths)
                  + f"   {gb / (us['qmv'] * 1e-6):7.0f} {gb / (us['pair'] * 1e-6):7.0f}", flush=True)
    dense = dense_rows(args, {k: v for k, v in paths.items() if k.startswith(("qmv", "narrow"))}) if args.dense else []
    if args.out:
        args.out.write_text(json.dumps({"commit": commit(), "card": card()[0], "results": results, "dense": dense},
                                       indent=1))


def dense_rows(args: argparse.Namespace, qmv_paths: dict[str, Any]) -> list[dict[str, Any]]:
    """A dense 8-bit projection over M rows (the decode step's, at batch M): MLX's `quantized_matmul`
    against the qmv kernel with the weights as one expert (every row routed to it)."""
    import mlx.nn as nn

    out = []
    print(f"\n{'M':>4} {'N x K':>11} {'mlx':>9} {'dense_k4':>9} {'dense_k2':>9} "
          + " ".join(f"{p:>11}" for p in qmv_paths) + "   (device us a call)")
    for N, K in ((8192, 2048), (2048, 4096), (512, 2048)):
        lin = nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), group_size=64, bits=8)
        lin.update({"weight": lin.weight, "scales": lin.scales.astype(mx.bfloat16),
                    "biases": lin.biases.astype(mx.bfloat16)})
        proj = {"weight": lin.weight[None], "scales": lin.scales[None], "biases": lin.biases[None]}
        for M in (int(m) for m in args.dense.split(",")):
            x = mx.random.normal((M, 1, K)).astype(mx.bfloat16)
            experts = mx.zeros((M,), dtype=mx.uint32)
            mx.eval(x, proj, experts)
            us = {"mlx": time_us(partial(lin, x), args.repeats)}
            calls = {f"dense_k{split}": partial(cuda_narrow_linear, x, lin.weight, lin.scales, lin.biases,
                                                split_k=split) for split in (4, 2)}  # ours, dense: one launch
            calls.update({path: partial(fn, x, proj, experts) for path, fn in qmv_paths.items()})
            for path, call in calls.items():
                try:
                    us[path] = time_us(call, args.repeats)
                except Exception as exc:
                    us[path] = float("nan")
                    print(f"  {path} failed: {exc!r}"[:300])
            out.append({"M": M, "N": N, "K": K, "us": us})
            print(f"{M:4d} {f'{N}x{K}':>11} {us['mlx']:9.1f} {us['dense_k4']:9.1f} {us['dense_k2']:9.1f} "
                  + " ".join(f"{us[p]:11.1f}" for p in qmv_paths), flush=True)
    return out


if __name__ == "__main__":
    main()

"""Compile our `mx.fast.cuda_kernel` sources with nvcc on a machine without a GPU, wrapped as MLX's
CUDA backend wraps them for its JIT (`mlx/backend/cuda/custom_kernel.cpp`'s `build_kernel`: the
default header, ours, `__global__ void` with a `const T*` per input, `T_shape` where the source
names it, a `T*` per output, the template arguments as `constexpr` / `using` lines), so a kernel's
compile errors show before a device lease (its arithmetic is pinned on the GPU by `kernel_check.py`).

    python benchmarks/gpu/cuda_compile_check.py --mlx-src DIR [--nvcc nvcc] [--arch sm_90] [--only NAME]

DIR holds MLX's source tree at the installed version's tag (`mlx/backend/cuda/device/*.cuh`; e.g.
`git archive v0.32.4 mlx/backend/cuda/device | tar x -C DIR` from a clone); nvcc from a CUDA
toolkit of 12.x or 13.x (the machine's CCCL headers stand in for the ones MLX ships).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CUDA_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float", "bool": "bool",
              "uint32": "uint32_t", "int32": "int32_t"}


@dataclass(frozen=True)
class KernelSpec:
    name: str
    source: str
    header: str
    inputs: list[tuple[str, str, int]]  # (name, dtype, ndim)
    outputs: list[tuple[str, str]]  # (name, dtype)
    template: list[tuple[str, int | bool | str]]  # str: a dtype name


def build(spec: KernelSpec) -> str:
    """The translation unit MLX's JIT compiles for `spec`."""
    lines = ['#include "mlx/backend/cuda/device/utils.cuh"', "#include <cooperative_groups.h>", spec.header,
             "namespace mlx::core::cu {", "namespace cg = cooperative_groups;",
             f"__global__ void custom_kernel_{spec.name}("]
    params = []
    for name, dtype, ndim in spec.inputs:
        params.append(f"    const {CUDA_TYPES[dtype]}* {name}")
        if ndim > 0 and f"{name}_shape" in spec.source:
            params.append(f"    const __grid_constant__ Shape {name}_shape")
        if ndim > 0 and f"{name}_strides" in spec.source:
            params.append(f"    const __grid_constant__ Strides {name}_strides")
        if ndim > 0 and f"{name}_ndim" in spec.source:
            params.append(f"    const __grid_constant__ int {name}_ndim")
    params += [f"    {CUDA_TYPES[dtype]}* {name}" for name, dtype in spec.outputs]
    lines.append(",\n".join(params) + ") {")
    for name, value in spec.template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {CUDA_TYPES[value]};")
    lines += [spec.source, "}", "}  // namespace mlx::core::cu"]
    return "\n".join(lines)


def specs() -> list[KernelSpec]:
    """Each kernel of the families' `kernels/` whose source this checks, at the 35B-A3B shape."""
    from mlx_relay.engine.models.qwen3_5.kernels import gated_delta_prefill as gdp

    out = []
    for has_mask in (False, True):
        for dtype in ("bfloat16", "float32"):
            inputs = [("q", dtype, 4), ("k", dtype, 4), ("v", dtype, 4), ("g", "float32", 3), ("beta", dtype, 3),
                      ("state_in", "float32", 4)] + ([("mask", "bool", 2)] if has_mask else [])
            out.append(KernelSpec(f"gated_delta_prefill_{dtype}_{has_mask}", gdp.cuda_source(has_mask), gdp.CUDA_HEADER,
                                  inputs, [("y", dtype), ("state_out", "float32")],
                                  [("Dk", 128), ("Dv", 128), ("Hk", 16), ("Hv", 32),
                                   ("InT", dtype), ("StT", "float32")]))
    from mlx_relay.engine.models.qwen3_5.kernels import grouped_qmm as gq

    for dtype in ("bfloat16", "float16"):
        for n, k in ((512, 2048), (2048, 512)):
            inputs = [("x", dtype, 2), ("w", "uint32", 3), ("scales", dtype, 3), ("biases", dtype, 3),
                      ("row_off", "int32", 1), ("tile_off", "int32", 1)]
            out.append(KernelSpec(f"grouped_qmm8_{dtype}_{n}x{k}", gq.cuda_source(), gq.CUDA_HEADER, inputs,
                                  [("y", dtype)], [("N", n), ("K", k), ("E", 256), ("T", dtype)]))
    from mlx_relay.engine.models.qwen3_5.kernels import grouped_qmv as gv

    for dtype in ("bfloat16", "float16"):
        for n, k in ((512, 2048), (2048, 512)):
            inputs = [("x", dtype, 3), ("w", "uint32", 3), ("scales", dtype, 3), ("biases", dtype, 3),
                      ("row_off", "int32", 1)]
            out.append(KernelSpec(f"grouped_qmv8_{dtype}_{n}x{k}", gv.cuda_source(), "", inputs,
                                  [("y", dtype)], [("N", n), ("K", k), ("E", 256), ("T", dtype)]))
    from mlx_relay.engine.models.qwen3_5.kernels import narrow_qmm as nq

    for dtype in ("bfloat16", "float16"):
        for n, k, split, stages in ((512, 2048, 1, 4), (2048, 512, 1, 4), (512, 2048, 1, 1), (512, 2048, 1, 3),
                                    (8192, 2048, 4, 4), (2048, 4096, 2, 2)):
            inputs = [("x", dtype, 3), ("w", "uint32", 3), ("scales", dtype, 3), ("biases", dtype, 3),
                      ("row_off", "int32", 1), ("tile_off", "int32", 1)]
            out.append(KernelSpec(f"narrow_qmm8_{dtype}_{n}x{k}_k{split}_s{stages}", nq.cuda_source(split, stages),
                                  nq.CUDA_HEADER, inputs, [("y", dtype)],
                                  [("N", n), ("K", k), ("E", 256 if split == 1 else 1), ("T", dtype)]))
        for n, k, split in ((8192, 2048, 4), (2048, 4096, 4), (512, 2048, 2)):
            inputs = [("x", dtype, 3), ("w", "uint32", 2), ("scales", dtype, 2), ("biases", dtype, 2)]
            out.append(KernelSpec(f"narrow_dense8_{dtype}_{n}x{k}_k{split}", nq.cuda_source(split, dense=True),
                                  nq.CUDA_HEADER, inputs, [("y", dtype)], [("N", n), ("K", k), ("E", 1), ("T", dtype)]))
    from mlx_relay.engine.models.qwen3_5.kernels import pair_qmv as pq

    for dtype in ("bfloat16", "float16"):
        for n, k, per_row in ((512, 2048, 8), (2048, 512, 1)):
            inputs = [("x", dtype, 2), ("w", "uint32", 3), ("scales", dtype, 3), ("biases", dtype, 3),
                      ("ids", "uint32", 1)]
            out.append(KernelSpec(f"pair_qmv8_{dtype}_{n}x{k}", pq.CUDA_SOURCE, "", inputs, [("y", dtype)],
                                  [("N", n), ("K", k), ("XDIV", per_row), ("WARPS", pq.WARPS), ("CPW", pq.CPW),
                                   ("T", dtype)]))
    from mlx_relay.engine.models.qwen3_5.kernels import expert_tiles

    for rt in (8, 64):
        out.append(KernelSpec(f"expert_tiles_{rt}", expert_tiles.OFFSETS_SOURCE, "", [("experts", "uint32", 1)],
                              [("row_off", "int32"), ("tile_off", "int32")], [("E", 256), ("RT", rt)]))
    from mlx_relay.engine.models.qwen3_5.kernels import moe

    for dtype in ("bfloat16", "float32"):
        inputs = [("h", dtype, 3), ("expert_out", dtype, 4), ("scores", dtype, 3), ("shared_gate", dtype, 3),
                  ("shared_out", dtype, 3)]
        out.append(KernelSpec(f"moe_combine_{dtype}", moe.COMBINE_SOURCE, moe.LEAD_AT, inputs, [("out", dtype)],
                              [("D", 2048), ("KTOP", 8), ("OutT", dtype)]))
        out.append(KernelSpec(f"moe_route_{dtype}", moe.ROUTE_SOURCE, moe.ROUTE_HEADER, [("logits", dtype, 3)],
                              [("inds", "uint32"), ("scores", dtype)],
                              [("E", 256), ("KTOP", 8), ("NORM", True), ("OutT", dtype)]))
    from mlx_relay.engine.kernels import quantized_attention as qa

    for bits in (8, 4):
        for name, source, first, extra in (("scores", qa.SCORES_SOURCE, "q", ("WARPS_", qa.WARPS)),
                                           ("weighted", qa.WEIGHTED_SOURCE, "p", ("CHUNK_", qa.CHUNK))):
            inputs = [(first, "bfloat16" if first == "q" else "float32", 4), ("w", "uint32", 4),
                      ("scales", "bfloat16", 4), ("biases", "bfloat16", 4)]
            out.append(KernelSpec(f"quantized_{name}_{bits}", source, qa.HEADER, inputs, [("out", "float32")],
                                  [("D", 256), ("R", 8), ("BITS", bits), ("GS", 64), extra, ("QT", "bfloat16")]))
    from mlx_relay.engine.models.qwen3_5.kernels import gated_delta as gd

    for dtype in ("bfloat16", "float32"):
        for T, keep in ((1, False), (3, True)):
            inputs = [("qkv", dtype, 3), ("z", dtype, 3), ("b", dtype, 3), ("a", dtype, 3), ("conv", dtype, 3),
                      ("conv_w", dtype, 3), ("A_log", "float32", 1), ("dt_bias", dtype, 1), ("ssm", "float32", 4),
                      ("norm_w", dtype, 1)]
            source = gd.CUDA_SOURCE.replace("__WARPS__", str(gd.WARPS)).replace("__NORM_EPS__", repr(1e-6))
            out.append(KernelSpec(f"gated_delta_mixer_{dtype}_T{T}", source, gd.CUDA_HEADER, inputs,
                                  [("y", dtype), ("conv_out", dtype), ("ssm_out", "float32")],
                                  [("T", T), ("K", 4), ("Hk", 16), ("Hv", 32), ("Dk", 128), ("Dv", 128),
                                   ("KEEP", keep), ("InT", dtype), ("ConvT", dtype), ("StT", "float32")]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mlx-src", required=True, type=Path)
    parser.add_argument("--nvcc", default="nvcc")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--only", default="", help="only the kernels whose name holds this")
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for spec in (s for s in specs() if args.only in s.name):
            path = Path(tmp) / f"{spec.name}.cu"
            path.write_text(build(spec))
            cmd = [args.nvcc, "-std=c++17", f"-arch={args.arch}", "-c", str(path), "-o", str(path.with_suffix(".o")),
                   "-I", str(args.mlx_src), "-Xptxas", "-v"]
            run = subprocess.run(cmd, capture_output=True, text=True)
            usage = [ln.strip() for ln in run.stderr.splitlines() if "registers" in ln or "spill" in ln]
            print(f"{spec.name}: {'ok' if run.returncode == 0 else 'FAILED'}  {' | '.join(usage)}")
            if run.returncode != 0:
                failed += 1
                print(run.stderr[-4000:], file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A mixture of experts' routed matmuls over many tokens as grouped GEMMs (GPU thread only; called
from the Qwen3.5 family's layer loop, `models/qwen3_5/layers.py`, for mlx-vlm's `SwitchGLU`).

    y = grouped_switch_glu(switch, x, inds)        # x [..., H], inds [..., k] -> [..., k, H]

mlx-vlm's `SwitchGLU` sorts a prefill chunk's (token, expert) pairs by expert and calls
`mx.gather_qmm(..., sorted_indices=True)`. MLX 0.32's CUDA backend reads no sort in the quantized
gather (`GatherQMM::eval_gpu`): it runs one single-row matmul per pair, reading the expert's whole
quantized weight matrix again for each of its tokens (19 ms a block for 2,048 tokens on an H100,
where the block's arithmetic is about 0.3 ms). Its float gather does read the sort: with one row
per pair and sorted expert indices, `GatherMM::eval_gpu` runs CUTLASS's grouped GEMM, one problem
per expert. So on a CUDA GPU, for a chunk with at least `PrefillOptions.grouped_min_routes` pairs,
the pairs are sorted by expert once and each projection runs over them grouped: 8-bit experts in groups of 64 by our
kernel, which reads the quantized weights in place (`kernels/grouped_qmm.py`); other quantized
experts dequantized once (`mx.dequantize`: every expert, as a chunk of 2,048 tokens routes to
nearly all of them; 0.5 GB of bfloat16 per projection of the 35B-A3B shape, freed after its
matmul) and multiplied with the float gather. Fewer pairs (decode, the MTP verify, small slices) run
on a CUDA GPU as one matrix-vector product a pair (`kernels/pair_qmv.py`); elsewhere it is the
library's own call (`SwitchGLU.__call__`), which `fallback` names.

The arithmetic is the library's: the same sort, the same activation, every weight dequantized as
the quantized matmul dequantizes it (float32 tests pin the grouped path against the library's on
a quantized fixture, `tests/test_prefill_forward.py`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.qwen3_5.kernels.expert_tiles import tiles
from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import few_rows, grouped_qmm
from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import ROWS_A_PASS


def use_grouped(switch: Any, routes: int, min_routes: int) -> bool:
    """Whether `switch`'s routed matmuls over `routes` pairs run grouped: on a CUDA GPU, for at least
    `min_routes` pairs, with projections the grouped path knows (no bias; quantized or float)."""
    if not cuda_kernels_available() or routes < min_routes:
        return False
    return all("bias" not in m and m.get("weight") is not None
               for m in (switch.gate_proj, switch.up_proj, switch.down_proj))


def expert_weights(m: Any) -> mx.array:
    """A `SwitchLinear`'s or `QuantizedSwitchLinear`'s weights [E, out, in] in float (dequantized
    as its quantized matmul reads them)."""
    if "scales" not in m:
        return m["weight"]
    return mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
                         mode=m.mode)


def grouped_switch_glu(switch: Any, x: mx.array, inds: mx.array, *, kernel: bool = True,
                       narrow: bool = False) -> mx.array:
    """`switch(x, inds)` (mlx-vlm's `SwitchGLU`: [..., k, H]) with each projection a grouped GEMM:
    quantized experts by `grouped_qmm` (with `kernel`, our kernel where it runs: 8-bit weights read
    in place; else dequantized), float ones as they are, through MLX's sorted `gather_mm`.

    The rows go in as [pairs, 1, H] made by the gather itself: on MLX 0.32.4's CUDA backend the sorted
    `gather_mm` (CUTLASS's grouped GEMM) given the same rows as a [pairs, H] array expanded to
    [pairs, 1, H] returns wrong values (relative error ~1.3 against a float32 truth on an H200, where
    this form is 0.006 as the library's `SwitchGLU` is: benchmarks/gpu/experts_truth.py,
    benchmarks/results/prefill-h200-2026-11-28/)."""
    k = inds.shape[-1]
    flat = inds.flatten()
    order = mx.argsort(flat)
    rows = x.reshape(-1, 1, x.shape[-1])[order // k]  # one row per pair, grouped by expert
    experts = flat[order]

    E = switch.up_proj["weight"].shape[0]
    # the narrow kernel's tiles, once for the three projections (one launch, not three)
    few = narrow and kernel and cuda_kernels_available() and few_rows(rows.shape[0], E, narrow=True)
    at = tiles(experts, E, ROWS_A_PASS) if few else None

    def project(m: Any, a: mx.array) -> mx.array:
        if "scales" in m:
            return grouped_qmm(a, m, experts, kernel=kernel, narrow=narrow, at=at)
        return mx.gather_mm(a, m["weight"].swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)

    up = project(switch.up_proj, rows)
    gate = project(switch.gate_proj, rows)
    out = project(switch.down_proj, switch.activation(up, gate))
    return out[mx.argsort(order)].reshape(*inds.shape, out.shape[-1])


def fallback(switch: Any, x: mx.array, inds: mx.array) -> mx.array:
    """The library's `SwitchGLU` call."""
    return switch(x, inds)

"""The family's dense 8-bit projections over few rows (GPU thread only): the layer loop
(`layers.py`: the decode step, the MTP verify and head, and every other forward through it) calls
each `nn.QuantizedLinear` through `dense(m, x)`, and each of the library's MLPs (the dense layers'
and the mixture of experts' shared expert) through `mlp(module, x)`.

Where the default device is a CUDA GPU and `x` holds `FEW_ROWS` rows (8 to 16: the decode step of
8 to 16 rows, a verify block of as many positions), the projection is `narrow_qmm.cuda_narrow_linear`
(the tensor cores with the rows as the narrow side, one launch); otherwise, and everywhere off a
CUDA GPU, it is the library's own call. Device time a call, CUPTI, on an H200 at `e80559b`
(benchmarks/results/gpu-h200-2026-11-28c/e80559b/grouped_kernels.txt), MLX's `quantized_matmul` against
ours at 8 rows: 110.4 / 19.6 us (8192 x 2048), 165.1 / 25.4 (2048 x 4096), 20.3 / 8.6 (512 x 2048);
at 1 and 2 rows MLX's is as fast or faster (12.2 / 15.7 us at one row of 8192 x 2048), so those stay
the library's. `tests/test_dense_projections.py` pins `mlp` to the library's call.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.activations import swiglu
from mlx_vlm.models.qwen3_5.language import Qwen3_5MLP

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_linear

FEW_ROWS = (8, 16)  # rows of x (inclusive) for which ours runs
SPLIT_K = 4  # the kernel's four warps along K: a dense projection has few blocks of columns


def fits(m: Any, x: mx.array) -> bool:
    """Whether `m(x)` can run as our kernel: an 8-bit affine `QuantizedLinear` (groups of 64, no
    bias) over 16-bit rows of its dtype, its shape whole tiles of the kernel's."""
    if not isinstance(m, nn.QuantizedLinear) or "bias" in m:
        return False
    N, K = m.weight.shape[0], x.shape[-1]
    return (m.bits == 8 and m.group_size == 64 and m.mode == "affine" and x.dtype in (mx.bfloat16, mx.float16)
            and m.scales.dtype == x.dtype and N % (64 // SPLIT_K) == 0 and K % (64 * SPLIT_K) == 0)


def dense(m: Any, x: mx.array) -> mx.array:
    """`m(x)`: ours for few rows on a CUDA GPU where `m` fits it, else the library's call."""
    rows = x.size // x.shape[-1]
    if FEW_ROWS[0] <= rows <= FEW_ROWS[1] and cuda_kernels_available() and fits(m, x):
        return cuda_narrow_linear(x, m.weight, m.scales, m.biases, split_k=SPLIT_K)
    return m(x)


def mlp(module: Any, x: mx.array) -> mx.array:
    """The library's gated MLP (mlx-vlm's `Qwen3_5MLP`, also the MoE's shared expert:
    `down(swiglu(gate(x), up(x)))`) with each projection through `dense`; any other module, its own call."""
    if type(module) is not Qwen3_5MLP:
        return module(x)
    return dense(module.down_proj, swiglu(dense(module.gate_proj, x), dense(module.up_proj, x)))

"""The family's dense 8-bit projections, each by its rows and shape (GPU thread only): the layer loop
(`layers.py`: the decode step, the MTP verify and head, and every other forward through it) calls
each `nn.QuantizedLinear` through `dense(m, x)` (projections of one input through `dense_many`: one
product where they load merged), and each of the library's MLPs (the dense layers' and the mixture
of experts' shared expert) through `mlp(module, x)`.

Where the default device is a CUDA GPU, `path` picks each call's arithmetic by its rows and shape,
from one H200's device time a call (CUPTI; `benchmarks/gpu/dense_rows_bench.py`, every projection
shape of the 35B-A3B shape at 8 to 2,048 rows, `benchmarks/results/gpu-h200-2026-11-29b/5f6d9bb/dense_rows.txt`):

- fewer than `FEW_ROWS` rows (the one-row decode step, a short verify block): the library's call
  (MLX's `qmv`; at 1 and 2 rows as fast or faster than ours: 12.2 / 15.7 us at one row of 8192 x 2048);
- 8 to `NARROW_ROWS` rows: `narrow_qmm.cuda_narrow_linear` where it `fits` (the tensor cores with
  the rows as the narrow side, one launch; 8192 x 2048 at 8 / 24 / 32 rows: 20.5 / 41.2 / 50.7 us
  against MLX's 33.1 / 67.1 / 69.1), else the library's call. (A dequantized product would take
  less device time for the narrowest outputs, 3.1 against 22.3 us for the shared expert's gate at 8
  rows, but it is two launches where these steps are bound by the host's ~10 us a launch: 6.9 of
  the 8-row decode step's 22 ms are gaps, `kernel_profile.txt`);
- more rows: dequantized, then a 16-bit matmul (cuBLAS), except the largest projections
  (`LARGE_WEIGHTS` elements) below `DEQUANTIZE_ROWS` rows, which stay the library's (8192 x 2048 at
  64 rows: 73.9 us MLX's, 85.0 dequantized); a dequantization reads the 8-bit weights once and
  writes them at 16 bits, so past a few dozen rows it costs less than MLX's quantized matmul
  (8192 x 2048 at 264 / 2,048 rows: 96.1 / 173.3 us against 130.6 / 451.4; 32 x 2048 at any: 6-7
  us against 30-35). A step's dense projections: 23.8 -> 9.5 ms at 264 rows (a 256-token slice
  beside 8 rows), 57.1 -> 18.1 ms at 2,048 (a prefill chunk);
- never for a projection of more than `HUGE_WEIGHTS` elements (the head: 248,320 x 2,048), whose
  16-bit copy would be a transient gigabyte: the library's call or, where it fits, ours.

Everywhere off a CUDA GPU every call is the library's own. `tests/test_dense_projections.py` pins
`mlp` to the library's call, the dequantized product to the library's (float32), and `path`'s
choices; `benchmarks/gpu/kernel_check.py` pins our kernel against a float32 truth.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.activations import swiglu
from mlx_vlm.models.qwen3_5.language import Qwen3_5MLP

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.merged_projections import merged_parts
from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_linear

FEW_ROWS = 8  # rows of x from which a CUDA GPU runs other than the library's call
NARROW_ROWS = 32  # ... up to which ours runs (where `fits`)
LARGE_WEIGHTS = 8192 * 2048  # a projection at least this large ...
DEQUANTIZE_ROWS = 128  # ... is dequantized from this many rows (below: the library's call)
HUGE_WEIGHTS = 64 << 20  # elements above which a projection is never dequantized (the head)
SPLIT_K = 4  # the kernel's four warps along K: a dense projection has few blocks of columns

DensePath = Literal["library", "narrow", "dequantize"]


def fits(m: Any, x: mx.array) -> bool:
    """Whether `m(x)` can run as our kernel: an 8-bit affine `QuantizedLinear` (groups of 64, no
    bias) over 16-bit rows of its dtype, its shape whole tiles of the kernel's."""
    if not isinstance(m, nn.QuantizedLinear) or "bias" in m:
        return False
    N, K = m.weight.shape[0], x.shape[-1]
    return (m.bits == 8 and m.group_size == 64 and m.mode == "affine" and x.dtype in (mx.bfloat16, mx.float16)
            and m.scales.dtype == x.dtype and N % (64 // SPLIT_K) == 0 and K % (64 * SPLIT_K) == 0)


def path(m: Any, x: mx.array) -> DensePath:
    """How `dense(m, x)` runs on a CUDA GPU (see the module docstring)."""
    rows = x.size // x.shape[-1]
    if not isinstance(m, nn.QuantizedLinear) or m.bits != 8 or m.mode != "affine" or rows < FEW_ROWS:
        return "library"  # (only 8-bit affine projections were measured)
    if rows <= NARROW_ROWS:
        return "narrow" if fits(m, x) else "library"
    N, K = m.weight.shape[0], x.shape[-1]
    if N * K > HUGE_WEIGHTS or (rows < DEQUANTIZE_ROWS and N * K >= LARGE_WEIGHTS):
        return "library"
    return "dequantize"


def dequantized(m: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """`m(x)` as its weights dequantized to `x`'s dtype, then a matmul (and its bias)."""
    w = mx.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits, mode=m.mode)
    y = x @ (w if w.dtype == x.dtype else w.astype(x.dtype)).T
    return y + m.bias if "bias" in m else y


def dense(m: Any, x: mx.array) -> mx.array:
    """`m(x)`, by `path` on a CUDA GPU, else the library's call."""
    if not cuda_kernels_available():
        return m(x)
    how = path(m, x)
    if how == "narrow":
        return cuda_narrow_linear(x, m.weight, m.scales, m.biases, split_k=SPLIT_K)
    if how == "dequantize":
        return dequantized(m, x)
    return m(x)


def dense_many(modules: Sequence[Any], x: mx.array, *, views: bool = False) -> tuple[mx.array, ...]:
    """Each of `modules` over `x`: one `dense` product where they are, in order, the parts of one
    merged weight (`models/merged_projections.py`), then split; else one call each. The split of a
    product over more than one row is not row-contiguous (each part's rows strided by the whole
    width): on a CUDA GPU it runs merged only where the caller reads the parts in place (`views`:
    our GatedDeltaNet mixer, router and combine read their inputs through their strides, MLX's
    elementwise operations too), or for one row, whose parts are contiguous. An attention layer's
    parts go through MLX's fused norms, which would copy each strided part first."""
    merged = merged_parts(modules)
    if merged is None or not runs_merged(x.size // x.shape[-1], cuda_kernels_available(), views):
        return tuple(dense(m, x) for m in modules)
    return merged.split(dense(merged.linear, x))


def runs_merged(rows: int, cuda: bool, views: bool = False) -> bool:
    """Whether `dense_many` runs a merged product over `rows` rows (see there)."""
    return rows == 1 or not cuda or views


def mlp(module: Any, x: mx.array) -> mx.array:
    """The library's gated MLP (mlx-vlm's `Qwen3_5MLP`, also the MoE's shared expert:
    `down(swiglu(gate(x), up(x)))`) with its projections through `dense_many` and `dense`; any other
    module, its own call."""
    if type(module) is not Qwen3_5MLP:
        return module(x)
    gate, up = dense_many((module.gate_proj, module.up_proj), x, views=True)  # read by `swiglu`'s elementwise
    return dense(module.down_proj, swiglu(gate, up))

"""A mixture of experts' routed matmuls over FEW (token, expert) pairs, one matrix-vector product a
pair, its expert's 8-bit weights read in place (GPU thread only; called from the Qwen3.5 family's
layer loop, `models/qwen3_5/layers.py`, for mlx-vlm's `SwitchGLU` in the decode step, the MTP verify
round and head, and slices too small for the grouped path).

    y = pair_switch_glu(switch, x, inds)       # x [..., H], inds [..., k] -> [..., k, H]

Why: MLX 0.32.4's CUDA `GatherQMM` runs each pair as a one-row matmul on a 64-row tensor-core tile
(`qmm_sm80`): the decode step of one row spends 2.3 of its 7.2 busy ms in 120 such calls over 8
pairs, 19 us a call to read 8 MB of weights, ~0.4 TB/s of an H200's 4.8; the step of 8 rows 4.9 of
15.1 ms (64 pairs), an MTP round at block 2 3.8 ms (16 pairs)
(`benchmarks/results/gpu-h200-2026-11-29c/b51f659/kernel_profile.txt`). `grouped_qmv` (a block per
expert) leaves most of the GPU idle at so few pairs. Here every pair is its own matrix-vector
product, as MLX's `qmv` runs a dense projection's one row:

- a thread block per (pair, `WARPS` x `CPW` output columns): 8 pairs of the up projection (512
  columns) are 256 blocks, of the down projection (2,048 columns) 1,024;
- a lane holds its slices of the pair's input row in registers (16 values a slice, `K / 512`
  slices), with each slice's sum: a slice is one quantization group's quarter, so
  sum_j (s q_j + b) x_j = s (sum_j q_j x_j) + b (sum_j x_j);
- a warp computes `CPW` columns: each lane reads 16 consecutive bytes of each column's weights
  (a warp reads 512 contiguous bytes a column), float32 sums reduced across the warp at the end;
- the gate and up projections read input row `pair / k` (a token's k pairs share its row), the
  down projection row `pair`.

The arithmetic is the library's (the same dequantization, the same activation between); the
rounding of the sums differs. `reference_pair_qmv` is the same product in plain MLX (the expert's
weights gathered and dequantized): the float32 CPU tests pin `pair_switch_glu` over it against the
library's `SwitchGLU` (`tests/test_pair_experts.py`), `benchmarks/gpu/kernel_check.py` the kernel
against a float32 truth on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available

#: pairs up to which a CUDA GPU runs this kernel (not yet measured against MLX's `gather_qmm` and the
#: grouped kernels: each pair reads its expert's weights, so its cost grows with the pairs where the
#: grouped kernels' does not; the narrow grouped path starts at 256, `prefill_options.NARROW_MIN_ROUTES`)
MAX_PAIRS = 256
WARPS = 4
CPW = 4  # columns a warp computes at once
SLICE_K = 32 * 16  # K a warp covers in one pass of 16-byte slices

# Template constants: N, K, XDIV (pairs a row), WARPS, CPW, T the rows' dtype. Inputs: x [R, K], w [E, N, K / 4]
# uint32, scales and biases [E, N, K / 64] of T, ids [P] uint32 (pair p's expert; its row p / XDIV).
CUDA_SOURCE = """
  constexpr int SLICE = 16;                 // weights a lane reads at once: 16 bytes, a quarter group
  constexpr int SL = K / (32 * SLICE);      // slices a lane
  constexpr int GROUPS = K / 64;
  constexpr int KW = K / 4;                 // 32-bit words a weight row
  const int p = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int n0 = (blockIdx.x * WARPS + warp) * CPW;
  const size_t e = static_cast<size_t>(ids[p]);
  const uint32_t* wexp = w + e * N * KW;
  const T* sexp = scales + e * N * GROUPS;
  const T* bexp = biases + e * N * GROUPS;
  const T* xr = x + static_cast<size_t>(p / XDIV) * K;

  float xv[SL][SLICE];
  float xsum[SL];
  #pragma unroll
  for (int s = 0; s < SL; ++s) {
    const int k = (s * 32 + lane) * SLICE;
    const uint4 lo = *reinterpret_cast<const uint4*>(xr + k);
    const uint4 hi = *reinterpret_cast<const uint4*>(xr + k + 8);
    const T* xl = reinterpret_cast<const T*>(&lo);
    const T* xh = reinterpret_cast<const T*>(&hi);
    xsum[s] = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
      xv[s][j] = static_cast<float>(xl[j]);
      xv[s][8 + j] = static_cast<float>(xh[j]);
    }
    #pragma unroll
    for (int j = 0; j < SLICE; ++j) xsum[s] += xv[s][j];
  }

  float acc[CPW];
  #pragma unroll
  for (int c = 0; c < CPW; ++c) acc[c] = 0.f;
  #pragma unroll
  for (int s = 0; s < SL; ++s) {
    const int k = (s * 32 + lane) * SLICE;
    const int g = k / 64;
    #pragma unroll
    for (int c = 0; c < CPW; ++c) {
      const size_t n = static_cast<size_t>(n0 + c);
      const uint4 wv = *reinterpret_cast<const uint4*>(wexp + n * KW + k / 4);
      const float sc = static_cast<float>(sexp[n * GROUPS + g]);
      const float bi = static_cast<float>(bexp[n * GROUPS + g]);
      const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
      float dot = 0.f;
      #pragma unroll
      for (int i = 0; i < 4; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
          dot = fmaf(static_cast<float>((words[i] >> (8 * j)) & 0xffu), xv[s][4 * i + j], dot);
      acc[c] = fmaf(sc, dot, fmaf(bi, xsum[s], acc[c]));
    }
  }
  #pragma unroll
  for (int c = 0; c < CPW; ++c) {
    float v = acc[c];
    #pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == c) y[static_cast<size_t>(p) * N + n0 + c] = static_cast<T>(v);
  }
"""

#: one projection over pairs: (rows [R, K], the projection, experts [P] uint32, pairs a row) -> [P, N]
PairProject = Callable[[mx.array, Any, mx.array, int], mx.array]


def projection_fits(proj: Any, K: int, dtype: mx.Dtype) -> bool:
    """Whether a `QuantizedSwitchLinear` over rows of `K` values of `dtype` is the kernel's: 8-bit
    affine in groups of 64, no bias, scales of the rows' 16-bit dtype, whole slices and blocks."""
    if "scales" not in proj or "bias" in proj or proj.get("biases") is None:
        return False
    N = proj["weight"].shape[1]
    return (getattr(proj, "bits", None) == 8 and getattr(proj, "group_size", None) == 64
            and getattr(proj, "mode", "affine") == "affine" and dtype in (mx.bfloat16, mx.float16)
            and proj["scales"].dtype == dtype and K % SLICE_K == 0 and N % (WARPS * CPW) == 0)


def fits(switch: Any, x: mx.array) -> bool:
    """Whether `switch`'s three projections over `x` are the kernel's."""
    H = x.shape[-1]
    inner = switch.up_proj["weight"].shape[1]
    return (projection_fits(switch.up_proj, H, x.dtype) and projection_fits(switch.gate_proj, H, x.dtype)
            and projection_fits(switch.down_proj, inner, x.dtype))


def use_pairs(switch: Any, x: mx.array, pairs: int) -> bool:
    """Whether `switch(x, inds)` over `pairs` pairs runs here: on a CUDA GPU, up to `MAX_PAIRS`, where it fits."""
    return cuda_kernels_available() and 0 < pairs <= MAX_PAIRS and fits(switch, x)


def cuda_pair_qmv(rows: mx.array, proj: Any, experts: mx.array, per_row: int) -> mx.array:
    """The kernel: `rows` [R, K] (pair p reads row p // per_row), experts [P] -> [P, N] (CUDA only)."""
    P = experts.shape[0]
    N, K = proj["weight"].shape[1], rows.shape[-1]
    kernel = mx.fast.cuda_kernel(
        name="relay_pair_qmv8", input_names=["x", "w", "scales", "biases", "ids"], output_names=["y"],
        source=CUDA_SOURCE)
    (y,) = kernel(
        inputs=[rows, proj["weight"], proj["scales"], proj["biases"], experts],
        template=[("N", N), ("K", K), ("XDIV", per_row), ("WARPS", WARPS), ("CPW", CPW), ("T", rows.dtype)],
        grid=(N // (WARPS * CPW) * 32 * WARPS, P, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(P, N)], output_dtypes=[rows.dtype])
    return y


def reference_pair_qmv(rows: mx.array, proj: Any, experts: mx.array, per_row: int) -> mx.array:
    """The kernel's product in plain MLX: each pair's row times its expert's dequantized weights."""
    ids = experts.astype(mx.int32)
    w = mx.dequantize(proj["weight"][ids], proj["scales"][ids], proj.get("biases")[ids] if "biases" in proj else None,
                      group_size=proj.group_size, bits=proj.bits, mode=proj.mode)  # [P, N, K]
    x = rows[mx.arange(experts.shape[0]) // per_row] if per_row > 1 else rows  # [P, K]
    return (w.astype(rows.dtype) @ x[:, :, None]).squeeze(-1)


def pair_switch_glu(switch: Any, x: mx.array, inds: mx.array, project: PairProject = cuda_pair_qmv) -> mx.array:
    """`switch(x, inds)` (mlx-vlm's `SwitchGLU`: [..., k, H]) as one product a pair and projection:
    gate and up over each token's row, the library's activation, down over each pair's."""
    k, H = inds.shape[-1], x.shape[-1]
    rows = x.reshape(-1, H)
    experts = inds.reshape(-1).astype(mx.uint32)
    up = project(rows, switch.up_proj, experts, k)
    gate = project(rows, switch.gate_proj, experts, k)
    out = project(switch.activation(up, gate), switch.down_proj, experts, 1)
    return out.reshape(*inds.shape, out.shape[-1])

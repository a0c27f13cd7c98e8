"""One projection of a mixture of experts over FEW rows an expert, its 8-bit weights read in place
(GPU thread only; called by `kernels/grouped_qmm.py`, which picks it by rows an expert).

    y = grouped_qmv(rows, proj, experts)     # rows [R, 1, K] sorted by expert, experts [R] -> y [R, 1, N]

The same contract as `grouped_qmm.grouped_qmm` (mlx-vlm's `QuantizedSwitchLinear`, 8-bit affine
groups of 64, its weights [E, N, K / 4] uint32, `scales` and `biases` [E, N, K / 64]); the same
fallback. Where `grouped_qmm`'s tensor-core kernel tiles 64 rows of one expert, so that a chunk of
a few hundred tokens (about 8 rows an expert of 256) leaves most of each tile empty and pays its
whole loop over K for them (593 us a projection of the 35B-A3B shape at 256 tokens on an H200,
the same at 512: `benchmarks/results/kernel-profile-h200-2026-11-28/`), this kernel streams each
expert's weights once through the CUDA cores, as a matrix-vector product does, for every row of
the expert at once:

- a thread block per (expert, 64 output columns), four warps of 16 columns each; an expert without
  rows returns at once (the grid is E x N/64, sized without a host sync);
- the expert's rows, `RG` (8) at a time, staged in shared memory (bf16/fp16 as they are);
- a warp computes four columns at a time: each lane reads 16 consecutive bytes of each column's
  weights (a warp reads 512 contiguous bytes of a row), so a lane's 16 weights share one
  quantization group: sum_j (s q_j + b) x_j = s (sum_j q_j x_j) + b (sum_j x_j), the sum of x
  shared by the four columns;
- float32 sums, reduced across the warp's lanes at the end of K (butterfly shuffles); lane
  c * RG + r writes row r of column c.

An expert with more than `RG` rows runs a pass per `RG` rows, reading its weights again (from L2):
the kernel is for few rows an expert; `grouped_qmm` routes many to the tensor-core kernel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

ROWS_A_PASS = 8  # RG: rows of one expert a pass (x in shared memory: RG x K 16-bit values)
COLS_A_BLOCK = 64  # BN
WARPS = 4

# Template constants: N, K, E; T the rows' (and output's) dtype. Inputs: x [R, 1, K] sorted by
# expert, w [E, N, K / 4] uint32, scales and biases [E, N, K / 64] of T, row_off [E + 1] int32
# (expert e's rows are row_off[e] .. row_off[e + 1]).
_CUDA_SOURCE = """
  constexpr int RG = __RG__, BN = __BN__, WARPS = __WARPS__;
  constexpr int CPW = __CPW__;      // columns a warp computes at once
  constexpr int SLICE = 16;         // weights a lane reads at once: 16 bytes, one group's
  constexpr int GROUPS = K / 64;
  constexpr int KW = K / 4;         // 32-bit words a weight row
  static_assert(BN % (WARPS * CPW) == 0, "whole column groups a warp");
  __shared__ __align__(16) T xs[RG * K];

  const int e = blockIdx.x;
  const int r_begin = row_off[e], r_end = row_off[e + 1];
  if (r_begin >= r_end) return;
  const int n_block = blockIdx.y * BN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t* wexp = w + (size_t)e * N * KW;
  const T* sexp = scales + (size_t)e * N * GROUPS;
  const T* bexp = biases + (size_t)e * N * GROUPS;

  for (int p = r_begin; p < r_end; p += RG) {
    const int rows = min(RG, r_end - p);
    __syncthreads();  // the last pass's reads of xs are done
    for (int v = threadIdx.x; v < RG * K / 8; v += blockDim.x) {
      const int r = v / (K / 8), c = (v % (K / 8)) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < rows) val = *reinterpret_cast<const uint4*>(x + (size_t)(p + r) * K + c);
      *reinterpret_cast<uint4*>(xs + r * K + c) = val;
    }
    __syncthreads();
    for (int n0 = n_block + warp * CPW; n0 < n_block + BN; n0 += WARPS * CPW) {
      float acc[CPW][RG];
      #pragma unroll
      for (int c = 0; c < CPW; ++c)
        #pragma unroll
        for (int r = 0; r < RG; ++r) acc[c][r] = 0.f;
      for (int k = lane * SLICE; k < K; k += 32 * SLICE) {
        const int g = k / 64;
        float q[CPW][SLICE], s[CPW], b[CPW];
        #pragma unroll
        for (int c = 0; c < CPW; ++c) {
          const uint4 wv = *reinterpret_cast<const uint4*>(wexp + (size_t)(n0 + c) * KW + k / 4);
          const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
          #pragma unroll
          for (int i = 0; i < 4; ++i)
            #pragma unroll
            for (int j = 0; j < 4; ++j) q[c][4 * i + j] = static_cast<float>((words[i] >> (8 * j)) & 0xffu);
          s[c] = static_cast<float>(sexp[(size_t)(n0 + c) * GROUPS + g]);
          b[c] = static_cast<float>(bexp[(size_t)(n0 + c) * GROUPS + g]);
        }
        #pragma unroll
        for (int r = 0; r < RG; ++r) {
          if (r >= rows) break;
          const uint4 lo = *reinterpret_cast<const uint4*>(xs + r * K + k);
          const uint4 hi = *reinterpret_cast<const uint4*>(xs + r * K + k + 8);
          const T* xl = reinterpret_cast<const T*>(&lo);
          const T* xh = reinterpret_cast<const T*>(&hi);
          float xv[SLICE];
          float xsum = 0.f;
          #pragma unroll
          for (int j = 0; j < 8; ++j) {
            xv[j] = static_cast<float>(xl[j]);
            xv[8 + j] = static_cast<float>(xh[j]);
          }
          #pragma unroll
          for (int j = 0; j < SLICE; ++j) xsum += xv[j];
          #pragma unroll
          for (int c = 0; c < CPW; ++c) {
            float dot = 0.f;
            #pragma unroll
            for (int j = 0; j < SLICE; ++j) dot = fmaf(q[c][j], xv[j], dot);
            acc[c][r] = fmaf(s[c], dot, fmaf(b[c], xsum, acc[c][r]));
          }
        }
      }
      #pragma unroll
      for (int c = 0; c < CPW; ++c)
        #pragma unroll
        for (int r = 0; r < RG; ++r) {
          float v = acc[c][r];
          #pragma unroll
          for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
          if (lane == ((c * RG + r) & 31) && r < rows) y[(size_t)(p + r) * N + n0 + c] = static_cast<T>(v);
        }
    }
  }
"""


class Shape(NamedTuple):
    """How the kernel splits the work: rows a pass (x in shared memory: rows x K 16-bit values),
    output columns a block, warps a block, columns a warp computes at once."""

    rows: int = ROWS_A_PASS
    cols: int = COLS_A_BLOCK
    warps: int = WARPS
    cols_a_warp: int = 4


def cuda_source(shape: Shape = Shape()) -> str:
    return (_CUDA_SOURCE.replace("__RG__", str(shape.rows)).replace("__BN__", str(shape.cols))
            .replace("__WARPS__", str(shape.warps)).replace("__CPW__", str(shape.cols_a_warp)))


def expert_counts(experts: mx.array, num_experts: int) -> mx.array:
    """Rows routed to each expert: [E] int32, counted on the device (no host sync)."""
    return mx.zeros((num_experts,), dtype=mx.int32).at[experts.astype(mx.int32)].add(1)


def starts(counts: mx.array) -> mx.array:
    """Where each of `counts`' runs starts in their concatenation, and the end: [len + 1] int32."""
    return mx.concatenate([mx.zeros((1,), dtype=mx.int32), mx.cumsum(counts)])


def row_offsets(experts: mx.array, num_experts: int) -> mx.array:
    """Each expert's first row in the sorted rows, and the end: [E + 1] int32."""
    return starts(expert_counts(experts, num_experts))


def cuda_grouped_qmv(rows: mx.array, proj: Any, experts: mx.array, shape: Shape = Shape()) -> mx.array:
    """The kernel (CUDA only; the shapes `grouped_qmm.kernel_fits` admits; `shape` other than the
    default for `benchmarks/gpu/grouped_kernels_bench.py`'s sweep)."""
    E, N, _ = proj["weight"].shape
    R, _, K = rows.shape
    kernel = mx.fast.cuda_kernel(
        name=f"relay_grouped_qmv8_{shape.rows}_{shape.cols}_{shape.warps}_{shape.cols_a_warp}",
        input_names=["x", "w", "scales", "biases", "row_off"], output_names=["y"], source=cuda_source(shape))
    (y,) = kernel(
        inputs=[rows, proj["weight"], proj["scales"], proj["biases"], row_offsets(experts, E)],
        template=[("N", N), ("K", K), ("E", E), ("T", rows.dtype)],
        grid=(E * 32 * shape.warps, N // shape.cols, 1), threadgroup=(32 * shape.warps, 1, 1),
        output_shapes=[(R, 1, N)], output_dtypes=[rows.dtype])
    return y

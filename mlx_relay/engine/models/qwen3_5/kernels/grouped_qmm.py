"""One projection of a mixture of experts over rows grouped by expert, its 8-bit weights read in
place (GPU thread only; called by `kernels/grouped_experts.py`).

    y = grouped_qmm(rows, proj, experts)     # rows [R, 1, K] sorted by expert, experts [R] -> y [R, 1, N]

`proj` is mlx-vlm's `QuantizedSwitchLinear` (weights [E, N, K] affine-quantized, `scales` and
`biases` per group of `group_size` along K): row r of the output is rows[r] @ W[experts[r]]^T. The
rows are [R, 1, K] as MLX's sorted `gather_mm` takes them (the fallback's; made by a gather, not
expanded from [R, K]: `grouped_experts.grouped_switch_glu` says why).

On a CUDA GPU, for 8-bit weights in groups of 64, this is one launch (`_CUDA_SOURCE`): a thread
block per tile of 64 rows of one expert and 64 output columns, staging 64 of K at a time in shared
memory (the rows as they are; the weights dequantized there, each byte once per tile) and
multiplying on the tensor cores (`nvcuda::wmma`, bf16 or fp16 in, float32 accumulated). An
expert's weights are read once per tile of its rows, so a 2,048-token chunk (about 64 rows an
expert of 256) reads each about once, where the dequantize-then-grouped-GEMM path writes and reads
every expert's weights in bfloat16 (3 of its 7 ms a layer on an H200:
benchmarks/results/prefill-h100-2026-11-28/). Which tile a block runs comes from two prefix sums
over the experts (`expert_tiles.tiles`: each expert's first row and first tile), computed on the device.
Elsewhere it is `fallback`: the weights dequantized and MLX's sorted `gather_mm`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.qwen3_5.kernels.expert_tiles import TILE_LOOKUP, Tiles, tiles
from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmv import cuda_grouped_qmv
from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_qmm

TILE_ROWS = 64
TILE_COLS = 64
TILE_K = 64
THREADS = 128  # four warps, each a 32 x 32 quarter of the tile

CUDA_HEADER = """
#include <mma.h>
"""

# Template constants: N, K, E; T the rows' (and output's) dtype. The weights are [E, N, K / 4]
# uint32 (four bytes each, little-endian), scales and biases [E, N, K / 64] of T.
_CUDA_SOURCE = """
  using namespace nvcuda;
  constexpr int BM = __BM__, BN = __BN__, BK = __BK__;
  constexpr int LDS = BK + 8;      // shared rows padded (16-bit elements: a multiple of 8)
  constexpr int LDC = BN + 4;
  constexpr int GROUPS = K / BK;   // quantization groups along K (group size = BK)
  __shared__ __align__(32) T xs[BM * LDS];
  __shared__ __align__(32) T ws[BN * LDS];
  __shared__ __align__(32) float cs[BM * LDC];
  constexpr int RT = BM;
__TILE__
  const int n0 = blockIdx.y * BN;
  const int tid = threadIdx.x;
  const int r0 = p, r1 = p + rows;

  const int warp = tid / 32;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);

  const uint32_t* wexp = w + (size_t)e * N * (K / 4);
  const T* sexp = scales + (size_t)e * N * GROUPS;
  const T* bexp = biases + (size_t)e * N * GROUPS;

  for (int k0 = 0; k0 < K; k0 += BK) {
    // the rows' tile: BM x BK, 8 elements (16 bytes) a load; rows past the expert's are zero
    for (int v = tid; v < BM * BK / 8; v += blockDim.x) {
      const int r = v / (BK / 8), c = (v % (BK / 8)) * 8;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r0 + r < r1) val = *reinterpret_cast<const uint4*>(x + (size_t)(r0 + r) * K + k0 + c);
      *reinterpret_cast<uint4*>(xs + r * LDS + c) = val;
    }
    // the weights' tile: BN x BK bytes, four a word, dequantized with the group's scale and bias
    const int g = k0 / BK;
    for (int v = tid; v < BN * BK / 4; v += blockDim.x) {
      const int n = v / (BK / 4), c = (v % (BK / 4)) * 4;
      const uint32_t word = wexp[(size_t)(n0 + n) * (K / 4) + (k0 + c) / 4];
      const float s = static_cast<float>(sexp[(size_t)(n0 + n) * GROUPS + g]);
      const float b = static_cast<float>(bexp[(size_t)(n0 + n) * GROUPS + g]);
      T* dst = ws + n * LDS + c;
      for (int i = 0; i < 4; ++i) dst[i] = static_cast<T>(s * static_cast<float>((word >> (8 * i)) & 0xffu) + b);
    }
    __syncthreads();
    for (int kk = 0; kk < BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf[2];
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], xs + (wm + 16 * i) * LDS + kk, LDS);
      for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(bf[j], ws + (wn + 16 * j) * LDS + kk, LDS);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], bf[j], acc[i][j]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(cs + (wm + 16 * i) * LDC + wn + 16 * j, acc[i][j], LDC, wmma::mem_row_major);
  __syncthreads();
  for (int v = tid; v < BM * BN; v += blockDim.x) {
    const int r = v / BN, c = v % BN;
    if (r0 + r < r1) y[(size_t)(r0 + r) * N + n0 + c] = static_cast<T>(cs[r * LDC + c]);
  }
"""


def cuda_source() -> str:
    return (_CUDA_SOURCE.replace("__TILE__", TILE_LOOKUP).replace("__BM__", str(TILE_ROWS))
            .replace("__BN__", str(TILE_COLS)).replace("__BK__", str(TILE_K)))


def kernel_fits(rows: mx.array, proj: Any) -> bool:
    """The weights and shapes the kernel was written for: 8-bit affine groups of 64 with biases,
    whole tiles of K and N, 16-bit rows."""
    if "scales" not in proj or proj.get("biases") is None:
        return False
    N = proj["weight"].shape[1]
    K = rows.shape[-1]
    return (rows.ndim == 3 and rows.shape[1] == 1 and proj.bits == 8 and proj.group_size == TILE_K
            and proj.mode == "affine" and K % TILE_K == 0
            and N % TILE_COLS == 0 and rows.dtype in (mx.bfloat16, mx.float16)
            and proj["scales"].dtype == rows.dtype)


#: rows an expert (on average) up to which `grouped_qmv`'s CUDA-core kernel runs a projection
#: (few rows: a chunk of up to ~500 tokens routed over 256 experts); above it this tensor-core one
FEW_ROWS_AN_EXPERT = 16
#: ... and up to which `narrow_qmm`'s tensor-core one does, where the caller asks for it: one projection
#: (up, 2,048 x 512) on an H200, device time: 302 us at 4,160 pairs (16 an expert) against 640 in
#: 64-row tiles, 498 against 677 at 8,256 (benchmarks/results/gpu-h200-2026-11-28d/)
NARROW_ROWS_AN_EXPERT = 32


def few_rows(rows: int, num_experts: int, *, narrow: bool = False) -> bool:
    """Whether `rows` routed over `num_experts` are few an expert (the few-row kernels' case; `narrow`:
    `narrow_qmm`'s)."""
    return rows <= (NARROW_ROWS_AN_EXPERT if narrow else FEW_ROWS_AN_EXPERT) * num_experts


def grouped_qmm(rows: mx.array, proj: Any, experts: mx.array, *, kernel: bool = True,
                narrow: bool = False, at: Tiles | None = None) -> mx.array:
    """See the module docstring: `rows` [R, 1, K], `experts` [R] (sorted) -> [R, 1, N]; `kernel`
    off: the fallback everywhere. Few rows an expert run `grouped_qmv`'s kernel (`narrow`:
    `narrow_qmm`'s, over the experts' `Tiles` `at` where the caller made them once for its projections)."""
    if kernel and cuda_kernels_available() and kernel_fits(rows, proj):
        if few_rows(rows.shape[0], proj["weight"].shape[0], narrow=narrow):
            if narrow:
                return cuda_narrow_qmm(rows, proj, experts, at=at)
            return cuda_grouped_qmv(rows, proj, experts)
        return cuda_grouped_qmm(rows, proj, experts)
    return fallback(rows, proj, experts)


def cuda_grouped_qmm(rows: mx.array, proj: Any, experts: mx.array) -> mx.array:
    """The kernel (CUDA only)."""
    E, N, _ = proj["weight"].shape
    R, _, K = rows.shape
    at = tiles(experts, E, TILE_ROWS)
    kernel = mx.fast.cuda_kernel(
        name="relay_grouped_qmm8", input_names=["x", "w", "scales", "biases", "row_off", "tile_off"],
        output_names=["y"], source=cuda_source(), header=CUDA_HEADER)
    (y,) = kernel(
        inputs=[rows, proj["weight"], proj["scales"], proj["biases"], at.row_off, at.tile_off],
        template=[("N", N), ("K", K), ("E", E), ("T", rows.dtype)],
        grid=(at.max_tiles * THREADS, N // TILE_COLS, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, 1, N)], output_dtypes=[rows.dtype])
    return y


def fallback(rows: mx.array, proj: Any, experts: mx.array) -> mx.array:
    """The weights dequantized (as the quantized matmul reads them) and MLX's sorted `gather_mm`
    (on CUDA: CUTLASS's grouped GEMM)."""
    from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import expert_weights

    return mx.gather_mm(rows, expert_weights(proj).swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)

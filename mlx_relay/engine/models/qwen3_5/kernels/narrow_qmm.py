"""An 8-bit projection over few rows on the tensor cores, the rows as the narrow side of the
product (GPU thread only; `grouped_qmm` calls it for few rows an expert with `--prefill-experts narrow`,
being measured: `benchmarks/gpu/kernel_check.py`, `grouped_kernels_bench.py`; the decode step's
dense projections are its other use, not yet wired).

    y = narrow_qmm(rows, proj, experts)      # rows [R, 1, K] sorted by expert, experts [R] -> y [R, 1, N]

The contract of `grouped_qmm.grouped_qmm` (mlx-vlm's `QuantizedSwitchLinear`: 8-bit affine groups
of 64, weights [E, N, K / 4] uint32, `scales` / `biases` [E, N, K / 64]); a dense projection is the
case E = 1 (every row routed to it). Where `grouped_qmv`'s CUDA cores make 16 float multiply-adds
a weight byte for 8 rows (bound by their instructions: 393 us a projection of the 35B-A3B shape at
2,112 pairs on an H200, where its weights take ~56 us to read), this kernel hands the products to
the tensor cores, `mma.sync` m16n8k16 with the WEIGHTS as the 16-row operand (16 output columns)
and 8 rows of x as the 8-column one (`D^T = W x^T`), so a row of x costs no instructions of its own
up to 8:

- a thread block per (expert, 64 output columns), four warps of 16 columns (or, `split_k`, fewer
  columns a block and the warps splitting K, their sums added in shared memory: a dense
  projection has too few blocks of 64 columns to keep the GPU's memory busy); the expert's rows 8
  a pass, read from global memory where the products need them (a lane's 16 values of a group at
  once; any K), each row's sum over each quantization group in shared memory;
- per group of 64 along K, a lane reads 16 consecutive weight bytes of two columns (g and g + 8 of
  its warp's 16: lane = 4 g + t reads bytes 16 t .. 16 t + 15) and the same 16 positions of row g
  of x, the next group's weights issued before this one's products;
- the dot product's order along K is free, so the fragment's k positions are permuted to match
  what a lane holds: in step s (0..3) of a group, the fragment's columns 2t, 2t+1, 2t+8, 2t+9 are
  bytes 16 t + 4 s + 0..3 (one 32-bit word of the weights; four consecutive values of x);
- the MMA multiplies the raw bytes q (exact in bf16/fp16: integers below 256) with x, float32
  sums; per group y += s * sum(q x) + b * sum(x) (the affine dequantization, as `grouped_qmv`);
- a byte becomes a float by a byte permute and an add (2^23 + q read as a float, less 2^23), two
  floats a 16-bit pair by one conversion.

An expert with more than 8 rows runs a pass per 8, reading its weights again (from L2).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmv import row_offsets

ROWS_A_PASS = 8  # the MMA's narrow side
COLS_A_BLOCK = 64  # four warps of 16 columns
THREADS = 128

# Template constants: N, K, E; T the rows' (and output's) dtype: bfloat16 or float16.
_CUDA_SOURCE = """
  constexpr int RG = 8, GS = 64;
  constexpr int WK = __WK__, WN = 4 / WK;    // the block's four warps: WN along the columns, WK along K
  constexpr int BN = 16 * WN;                // output columns a block
  constexpr int GROUPS = K / GS;
  constexpr int KSPAN = GROUPS / WK;         // groups a warp sums (WK divides K / 64)
  constexpr int KW = K / 4;                  // 32-bit words a weight row
  static_assert(GROUPS % WK == 0, "whole groups a warp");
  __shared__ float xsum[RG * GROUPS];        // each row's sum over each quantization group
  __shared__ float part[WK > 1 ? WK * WN * 32 * 4 : 1];  // the K-split warps' sums, reduced at the end

  const int e = blockIdx.x;
  const int r_begin = row_off[e], r_end = row_off[e + 1];
  if (r_begin >= r_end) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int wn = warp % WN, wk = warp / WN;
  const int g0 = wk * KSPAN, g1 = g0 + KSPAN;  // this warp's groups along K
  const int n_lo = blockIdx.y * BN + wn * 16 + g, n_hi = n_lo + 8;
  const uint32_t* w_lo = w + ((size_t)e * N + n_lo) * KW;
  const uint32_t* w_hi = w + ((size_t)e * N + n_hi) * KW;
  const T* s_lo = scales + ((size_t)e * N + n_lo) * GROUPS;
  const T* s_hi = scales + ((size_t)e * N + n_hi) * GROUPS;
  const T* b_lo = biases + ((size_t)e * N + n_lo) * GROUPS;
  const T* b_hi = biases + ((size_t)e * N + n_hi) * GROUPS;

  for (int p = r_begin; p < r_end; p += RG) {
    const int rows = min(RG, r_end - p);
    __syncthreads();  // the last pass's reads of xsum and part are done
    for (int v = threadIdx.x; v < RG * GROUPS; v += blockDim.x) {
      const int r = v / GROUPS, gi = v % GROUPS;
      float acc = 0.f;
      if (r < rows) {
        const T* xr = x + (size_t)(p + r) * K + gi * GS;
        for (int j = 0; j < GS; ++j) acc += static_cast<float>(xr[j]);
      }
      xsum[v] = acc;
    }
    __syncthreads();

    // this lane's row of x (the MMA's column g): 16 values a group, read where the products need them
    const bool has_row = g < rows;
    const T* xg = x + (size_t)(p + (has_row ? g : 0)) * K;
    float y0 = 0.f, y1 = 0.f, y2 = 0.f, y3 = 0.f;  // (n_lo, row 2t), (n_lo, 2t+1), (n_hi, 2t), (n_hi, 2t+1)
    uint4 next_lo = *reinterpret_cast<const uint4*>(w_lo + g0 * (GS / 4) + 4 * t);
    uint4 next_hi = *reinterpret_cast<const uint4*>(w_hi + g0 * (GS / 4) + 4 * t);
    for (int gi = g0; gi < g1; ++gi) {
      const uint4 cur_lo = next_lo, cur_hi = next_hi;
      if (gi + 1 < g1) {  // the next group's bytes in flight during this one's products
        next_lo = *reinterpret_cast<const uint4*>(w_lo + (gi + 1) * (GS / 4) + 4 * t);
        next_hi = *reinterpret_cast<const uint4*>(w_hi + (gi + 1) * (GS / 4) + 4 * t);
      }
      uint4 xa = make_uint4(0, 0, 0, 0), xb = make_uint4(0, 0, 0, 0);  // x[g][gi*64 + 16t .. + 15]
      if (has_row) {
        xa = *reinterpret_cast<const uint4*>(xg + gi * GS + 16 * t);
        xb = *reinterpret_cast<const uint4*>(xg + gi * GS + 16 * t + 8);
      }
      const uint32_t lo_words[4] = {cur_lo.x, cur_lo.y, cur_lo.z, cur_lo.w};
      const uint32_t hi_words[4] = {cur_hi.x, cur_hi.y, cur_hi.z, cur_hi.w};
      const uint32_t x_words[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
      #pragma unroll
      for (int s = 0; s < 4; ++s) {
        // step s: the fragment's k columns 2t, 2t+1, 2t+8, 2t+9 are bytes 16t + 4s + 0..3 of the group:
        // registers (column g, k, k+1), (g + 8, k, k+1), (g, k+2, k+3), (g + 8, k+2, k+3); x's (k, k+1), (k+2, k+3)
        const uint32_t a0 = RelayNarrow<T>::pair(lo_words[s], 0), a1 = RelayNarrow<T>::pair(hi_words[s], 0);
        const uint32_t a2 = RelayNarrow<T>::pair(lo_words[s], 1), a3 = RelayNarrow<T>::pair(hi_words[s], 1);
        RelayNarrow<T>::mma(c0, c1, c2, c3, a0, a1, a2, a3, x_words[2 * s], x_words[2 * s + 1]);
      }
      const float sl = static_cast<float>(s_lo[gi]), sh = static_cast<float>(s_hi[gi]);
      const float bl = static_cast<float>(b_lo[gi]), bh = static_cast<float>(b_hi[gi]);
      const float x0 = xsum[(2 * t) * GROUPS + gi], x1 = xsum[(2 * t + 1) * GROUPS + gi];
      y0 += sl * c0 + bl * x0;
      y1 += sl * c1 + bl * x1;
      y2 += sh * c2 + bh * x0;
      y3 += sh * c3 + bh * x1;
    }
    if (WK > 1) {  // the K-split warps' sums: warp wk = 0 of each column group adds the others'
      float* mine = part + ((wk * WN + wn) * 32 + lane) * 4;
      mine[0] = y0; mine[1] = y1; mine[2] = y2; mine[3] = y3;
      __syncthreads();
      if (wk == 0) {
        for (int j = 1; j < WK; ++j) {
          const float* other = part + ((j * WN + wn) * 32 + lane) * 4;
          y0 += other[0]; y1 += other[1]; y2 += other[2]; y3 += other[3];
        }
      }
      if (wk != 0) continue;
    }
    const int r0 = 2 * t, r1 = 2 * t + 1;
    if (r0 < rows) {
      y[(size_t)(p + r0) * N + n_lo] = static_cast<T>(y0);
      y[(size_t)(p + r0) * N + n_hi] = static_cast<T>(y2);
    }
    if (r1 < rows) {
      y[(size_t)(p + r1) * N + n_lo] = static_cast<T>(y1);
      y[(size_t)(p + r1) * N + n_hi] = static_cast<T>(y3);
    }
  }
"""

# Before the kernel, per 16-bit type T: `pair`, a weight word's bytes (half 0: bytes 0 and 1; 1:
# bytes 2 and 3) as a pair of T (exact: integers below 256; the pack chosen by overload, as NVRTC
# need not have <type_traits>); `mma`, the m16n8k16 MMA in T with float32 sums (its PTX type names
# spelled once, in the macro).
CUDA_HEADER = """
__device__ __forceinline__ float relay_byte(uint32_t word, uint32_t byte) {
  return __uint_as_float(__byte_perm(word, 0x4Bu, 0x4550u + byte)) - 8388608.f;  // (2^23 + q) - 2^23
}

__device__ __forceinline__ uint32_t relay_pack(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ uint32_t relay_pack(float lo, float hi, __half) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

template <typename T> struct RelayNarrow {
  static __device__ __forceinline__ uint32_t pair(uint32_t word, int half) {
    return relay_pack(relay_byte(word, 2 * half), relay_byte(word, 2 * half + 1), T());
  }
  static __device__ __forceinline__ void mma(float& c0, float& c1, float& c2, float& c3, uint32_t a0, uint32_t a1,
                                             uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1);
};

#define RELAY_NARROW_MMA(T, PTX_TYPE)                                                                        \
  template <> __device__ __forceinline__ void RelayNarrow<T>::mma(                                           \
      float& c0, float& c1, float& c2, float& c3, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,         \
      uint32_t b0, uint32_t b1) {                                                                             \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, "          \
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                                     \
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1)); \
  }
RELAY_NARROW_MMA(__nv_bfloat16, "bf16")
RELAY_NARROW_MMA(__half, "f16")
"""


def cuda_source(split_k: int = 1) -> str:
    """`split_k`: the block's four warps along K (1: four column groups of 16 over all of K, for many
    experts; 2 or 4: fewer columns a block, each warp a share of K, summed in shared memory: more
    warps in flight for a dense projection's few blocks)."""
    return _CUDA_SOURCE.replace("__WK__", str(split_k))


def cuda_narrow_qmm(rows: mx.array, proj: Any, experts: mx.array, split_k: int = 1) -> mx.array:
    """The kernel (CUDA only; 8-bit groups of 64, N a multiple of 64 / `split_k`, K of 64 x `split_k`,
    16-bit rows)."""
    E, N, _ = proj["weight"].shape
    R, _, K = rows.shape
    kernel = mx.fast.cuda_kernel(
        name=f"relay_narrow_qmm8_k{split_k}", input_names=["x", "w", "scales", "biases", "row_off"],
        output_names=["y"], source=cuda_source(split_k), header=CUDA_HEADER)
    (y,) = kernel(
        inputs=[rows, proj["weight"], proj["scales"], proj["biases"], row_offsets(experts, E)],
        template=[("N", N), ("K", K), ("E", E), ("T", rows.dtype)],
        grid=(E * THREADS, N // (COLS_A_BLOCK // split_k), 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, 1, N)], output_dtypes=[rows.dtype])
    return y

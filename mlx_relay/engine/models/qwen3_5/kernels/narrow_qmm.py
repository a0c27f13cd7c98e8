"""An 8-bit projection over few rows on the tensor cores, the rows as the narrow side of the
product (GPU thread only): the family's dense projections over 8 to 32 rows (`kernels/dense.py`:
`cuda_narrow_linear`) and, with `--prefill-experts narrow` (a CUDA GPU's default), `grouped_qmm`'s
few rows an expert (`cuda_narrow_qmm`; checked by `benchmarks/gpu/kernel_check.py`, timed by
`grouped_kernels_bench.py`).

    y = narrow_qmm(rows, proj, experts)      # rows [R, 1, K] sorted by expert, experts [R] -> y [R, 1, N]

The contract of `grouped_qmm.grouped_qmm` (mlx-vlm's `QuantizedSwitchLinear`: 8-bit affine groups
of 64, weights [E, N, K / 4] uint32, `scales` / `biases` [E, N, K / 64]); a dense projection is the
case E = 1 (every row routed to it). Where `grouped_qmv`'s CUDA cores make 16 float multiply-adds
a weight byte for 8 rows (bound by their instructions: 393 us a projection of the 35B-A3B shape at
2,112 pairs on an H200, where its weights take ~56 us to read), this kernel hands the products to
the tensor cores, `mma.sync` m16n8k16 with the WEIGHTS as the 16-row operand (16 output columns)
and 8 rows of x as the 8-column one (`D^T = W x^T`), so a row of x costs no instructions of its own
up to 8:

- a thread block per tile of up to 8 rows of one expert (the tiles from prefix sums of the rows an
  expert, as `grouped_qmm`'s: an expert with many rows runs its tiles side by side, not a pass
  after another) and 64 output columns, four warps of 16 columns (or, `split_k`, fewer columns a
  block and the warps splitting K, their sums added in shared memory: a dense projection has too
  few blocks of 64 columns to keep the GPU's memory busy);
- the tile's rows staged in shared memory once (only the rows it has: one row of a dense projection
  stages one; rows padded by 16 bytes so the 8 rows a warp reads fall in different banks; read
  where they are when 8 rows of K do not fit in 40 KB), each row's sum over each quantization group
  beside them; the MMA's columns past the tile's rows read zeros;
- per group of 64 along K, a lane reads 16 consecutive weight bytes of two columns (g and g + 8 of
  its warp's 16: lane = 4 g + t reads bytes 16 t .. 16 t + 15) and the same 16 positions of row g
  of x; the weights and their scales and biases of `STAGES` groups are in flight at once (a ring
  of registers: the products of one group wait on loads issued `STAGES` groups earlier);
- the dot product's order along K is free, so the fragment's k positions are permuted to match
  what a lane holds: in step s (0..3) of a group, the fragment's columns 2t, 2t+1, 2t+8, 2t+9 are
  bytes 16 t + 4 s + 0..3 (one 32-bit word of the weights; four consecutive values of x);
- the MMA multiplies the raw bytes q (exact in bf16/fp16: integers below 256) with x, float32
  sums; per group y += s * sum(q x) + b * sum(x) (the affine dequantization, as `grouped_qmv`);
- a byte becomes a float by a byte permute and an add (2^23 + q read as a float, less 2^23), two
  floats a 16-bit pair by one conversion.

An expert's tiles each read its weights (the second from L2, where they run together).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.models.qwen3_5.kernels.expert_tiles import TILE_LOOKUP, Tiles, tiles

ROWS_A_PASS = 8  # the MMA's narrow side
COLS_A_BLOCK = 64  # four warps of 16 columns
THREADS = 128
STAGES = 4  # groups of 64 weights a lane has in flight

# Template constants: N, K, E; T the rows' (and output's) dtype: bfloat16 or float16.
_CUDA_SOURCE = """
  constexpr int RG = 8, GS = 64;
  constexpr int WK = __WK__, WN = 4 / WK;    // the block's four warps: WN along the columns, WK along K
  constexpr int STAGES = __STAGES__;         // groups of weights (and their scales) in flight a lane
  constexpr int BN = 16 * WN;                // output columns a block
  constexpr int GROUPS = K / GS;
  constexpr int KSPAN = GROUPS / WK;         // groups a warp sums (WK divides K / 64)
  constexpr int KW = K / 4;                  // 32-bit words a weight row
  constexpr int XS = K + 8;                  // a staged row of x, padded (rows 16 bytes apart in the banks)
  constexpr bool STAGED = RG * XS * 2 <= 40 * 1024;  // x in shared memory (else read where it is)
  static_assert(GROUPS % WK == 0, "whole groups a warp");
  __shared__ __align__(16) T xs[STAGED ? RG * XS : 8];
  __shared__ float xsum[RG * GROUPS];        // each row's sum over each quantization group
  __shared__ float part[WK > 1 ? WK * WN * 32 * 4 : 1];  // the K-split warps' sums
__TILE__
  // the tile's rows and their sums over each group: a thread per 8 values, 8 threads a group,
  // summed by shuffles; only the rows the tile has (a whole warp's trip count alike: the bound is
  // rounded up to 32 values, the rest past the tile's rows). Rows past them are never read (the
  // products read zeros for them) and their sums never written out.
  const int staged = ((rows * (K / 8) + 31) / 32) * 32;
  for (int v = threadIdx.x; v < staged; v += blockDim.x) {
    const int r = v / (K / 8), c = (v % (K / 8)) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < rows) val = *reinterpret_cast<const uint4*>(x + (size_t)(p + r) * K + c);
    if (STAGED && r < rows) *reinterpret_cast<uint4*>(xs + r * XS + c) = val;
    const T* h = reinterpret_cast<const T*>(&val);
    float acc = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) acc += static_cast<float>(h[j]);
    acc += __shfl_xor_sync(0xffffffffu, acc, 4);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if ((v & 7) == 0 && r < rows) xsum[r * GROUPS + c / GS] = acc;
  }
  __syncthreads();

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int wn = warp % WN, wk = warp / WN;
  const int g0 = wk * KSPAN, g1 = g0 + KSPAN;  // this warp's groups along K
  const int n_lo = blockIdx.y * BN + wn * 16 + g, n_hi = n_lo + 8;
  const uint32_t* w_lo = w + ((size_t)e * N + n_lo) * KW + 4 * t;
  const uint32_t* w_hi = w + ((size_t)e * N + n_hi) * KW + 4 * t;
  const T* s_lo = scales + ((size_t)e * N + n_lo) * GROUPS;
  const T* s_hi = scales + ((size_t)e * N + n_hi) * GROUPS;
  const T* b_lo = biases + ((size_t)e * N + n_lo) * GROUPS;
  const T* b_hi = biases + ((size_t)e * N + n_hi) * GROUPS;
  // this lane's row of x (the MMA's column g): 16 values a group (rows past the tile's are zeros)
  const bool live = g < rows;  // the MMA's column g: a row of the tile, else zeros
  const T* xg = STAGED ? xs + min(g, rows - 1) * XS : x + (size_t)(p + min(g, rows - 1)) * K;

  // a ring of STAGES groups in registers: a group's 2 x 16 weight bytes and 4 scale / bias values
  uint4 wl[STAGES], wh[STAGES];
  T sl[STAGES], sh[STAGES], bl[STAGES], bh[STAGES];
  #pragma unroll
  for (int i = 0; i < STAGES; ++i) {
    const int gi = g0 + i;
    if (gi < g1) {
      wl[i] = *reinterpret_cast<const uint4*>(w_lo + gi * (GS / 4));
      wh[i] = *reinterpret_cast<const uint4*>(w_hi + gi * (GS / 4));
      sl[i] = s_lo[gi]; sh[i] = s_hi[gi]; bl[i] = b_lo[gi]; bh[i] = b_hi[gi];
    }
  }
  float y0 = 0.f, y1 = 0.f, y2 = 0.f, y3 = 0.f;  // (n_lo, row 2t), (n_lo, 2t+1), (n_hi, 2t), (n_hi, 2t+1)
  for (int base = g0; base < g1; base += STAGES) {
    #pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      const int gi = base + i;
      if (gi < g1) {
        uint4 xa = make_uint4(0, 0, 0, 0), xb = make_uint4(0, 0, 0, 0);  // x[g][gi*64 + 16t .. + 15]
        if (live) {
          xa = *reinterpret_cast<const uint4*>(xg + gi * GS + 16 * t);
          xb = *reinterpret_cast<const uint4*>(xg + gi * GS + 16 * t + 8);
        }
        const uint32_t lo_words[4] = {wl[i].x, wl[i].y, wl[i].z, wl[i].w};
        const uint32_t hi_words[4] = {wh[i].x, wh[i].y, wh[i].z, wh[i].w};
        const uint32_t x_words[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        const float scl = static_cast<float>(sl[i]), sch = static_cast<float>(sh[i]);
        const float bil = static_cast<float>(bl[i]), bih = static_cast<float>(bh[i]);
        if (gi + STAGES < g1) {  // this stage's next group in flight during the products below
          wl[i] = *reinterpret_cast<const uint4*>(w_lo + (gi + STAGES) * (GS / 4));
          wh[i] = *reinterpret_cast<const uint4*>(w_hi + (gi + STAGES) * (GS / 4));
          sl[i] = s_lo[gi + STAGES]; sh[i] = s_hi[gi + STAGES]; bl[i] = b_lo[gi + STAGES]; bh[i] = b_hi[gi + STAGES];
        }
        float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
        #pragma unroll
        for (int s = 0; s < 4; ++s) {
          // step s: the fragment's k columns 2t, 2t+1, 2t+8, 2t+9 are bytes 16t + 4s + 0..3 of the group:
          // registers (column g, k, k+1), (g + 8, k, k+1), (g, k+2, k+3), (g + 8, k+2, k+3); x's (k, k+1), (k+2, k+3)
          const uint32_t a0 = RelayNarrow<T>::pair(lo_words[s], 0), a1 = RelayNarrow<T>::pair(hi_words[s], 0);
          const uint32_t a2 = RelayNarrow<T>::pair(lo_words[s], 1), a3 = RelayNarrow<T>::pair(hi_words[s], 1);
          RelayNarrow<T>::mma(c0, c1, c2, c3, a0, a1, a2, a3, x_words[2 * s], x_words[2 * s + 1]);
        }
        const float x0 = xsum[(2 * t) * GROUPS + gi], x1 = xsum[(2 * t + 1) * GROUPS + gi];
        y0 += scl * c0 + bil * x0;
        y1 += scl * c1 + bil * x1;
        y2 += sch * c2 + bih * x0;
        y3 += sch * c3 + bih * x1;
      }
    }
  }
  if (WK > 1) {  // the K-split warps' sums: warp wk = 0 of each column group adds the others'
    float* mine = part + ((wk * WN + wn) * 32 + lane) * 4;
    mine[0] = y0; mine[1] = y1; mine[2] = y2; mine[3] = y3;
    __syncthreads();
    if (wk != 0) return;
    for (int j = 1; j < WK; ++j) {
      const float* other = part + ((j * WN + wn) * 32 + lane) * 4;
      y0 += other[0]; y1 += other[1]; y2 += other[2]; y3 += other[3];
    }
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


_GROUPED_TILE = "  constexpr int RT = RG;\n" + TILE_LOOKUP

_DENSE_TILE = """  // a dense projection (E = 1): tile b is rows 8 b .. 8 b + 7 of x's R
  const int e = 0, p = blockIdx.x * RG, rows = min(RG, (int)x_shape[0] - p);
"""

def cuda_source(split_k: int = 1, stages: int = STAGES, dense: bool = False) -> str:
    """`split_k`: the block's four warps along K (1: four column groups of 16 over all of K, for many
    experts; 2 or 4: fewer columns a block, each warp a share of K, summed in shared memory: more
    warps in flight for a dense projection's few blocks). `stages`: groups of weights in flight a lane.
    `dense`: one matrix (E = 1), the tiles x's rows 8 at a time (no offsets)."""
    return (_CUDA_SOURCE.replace("__TILE__", _DENSE_TILE if dense else _GROUPED_TILE)
            .replace("__WK__", str(split_k)).replace("__STAGES__", str(stages)))


def cuda_narrow_qmm(rows: mx.array, proj: Any, experts: mx.array, split_k: int = 1, stages: int = STAGES,
                    at: Tiles | None = None) -> mx.array:
    """The kernel (CUDA only; 8-bit groups of 64, N a multiple of 64 / `split_k`, K of 64 x `split_k`,
    16-bit rows; `at`: the experts' `Tiles` where the caller has them)."""
    E, N, _ = proj["weight"].shape
    R, _, K = rows.shape
    at = at or tiles(experts, E, ROWS_A_PASS)
    kernel = mx.fast.cuda_kernel(
        name=f"relay_narrow_qmm8_k{split_k}_s{stages}",
        input_names=["x", "w", "scales", "biases", "row_off", "tile_off"],
        output_names=["y"], source=cuda_source(split_k, stages), header=CUDA_HEADER)
    (y,) = kernel(
        inputs=[rows, proj["weight"], proj["scales"], proj["biases"], at.row_off, at.tile_off],
        template=[("N", N), ("K", K), ("E", E), ("T", rows.dtype)],
        grid=(at.max_tiles * THREADS, N // (COLS_A_BLOCK // split_k), 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, 1, N)], output_dtypes=[rows.dtype])
    return y


def cuda_narrow_linear(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, split_k: int = 4,
                       stages: int = STAGES) -> mx.array:
    """A dense 8-bit projection (an `nn.QuantizedLinear`'s weight [N, K / 4], scales and biases [N, K / 64],
    groups of 64, no bias of its own) of `x` [..., K] over few rows: [..., N]. One launch."""
    N, K = weight.shape[0], x.shape[-1]
    rows = x.reshape(-1, 1, K)
    R = rows.shape[0]
    kernel = mx.fast.cuda_kernel(
        name=f"relay_narrow_dense8_k{split_k}_s{stages}", input_names=["x", "w", "scales", "biases"],
        output_names=["y"], source=cuda_source(split_k, stages, dense=True), header=CUDA_HEADER)
    (y,) = kernel(
        inputs=[rows, weight, scales, biases], template=[("N", N), ("K", K), ("E", 1), ("T", x.dtype)],
        grid=(-(-R // ROWS_A_PASS) * THREADS, N // (COLS_A_BLOCK // split_k), 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(R, 1, N)], output_dtypes=[x.dtype])
    return y.reshape(*x.shape[:-1], N)

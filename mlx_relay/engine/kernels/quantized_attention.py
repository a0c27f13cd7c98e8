"""The two products of an attention over quantized keys and values, read in their quantized form
(GPU thread only; called by `models/kv_quant.blockwise_attention` for a long context on a CUDA GPU).

    scores = quantized_scores(q, keys, bits, group)       # q [B, Hkv, R, D] x keys -> [B, Hkv, R, L] float32
    out = quantized_weighted(p, values, bits, group)      # p [B, Hkv, R, L] x values -> [B, Hkv, R, D] float32

`keys` / `values` are MLX's affine quantized triple over the last axis (`packed [B, Hkv, L, D * bits / 32]
uint32, scales and biases [B, Hkv, L, D / group]`, a view of the cache's buffers: every input is read
through its strides, so a block of keys sliced from the buffer is not copied). The R rows are one key
head's query heads (and positions), as `blockwise_attention` groups them. MLX 0.32.4's CUDA
`quantized_matmul` has no kernel for most of these shapes, so the attention dequantized each block to
a float copy first: 16 rows at 128K tokens held 12.5-13.7 GB of such copies queued ahead of the device
on an H200 (`benchmarks/results/gpu-h200-2026-11-29f/`). Here each key or value is dequantized in
registers where it is used, in float32 (the value q * scale + bias of `mx.dequantize`, rounded to the
queries' dtype as the copy was):

- `quantized_scores`: a warp per key, each lane D / 32 of its values, the R query rows in shared
  memory (float32), a warp sum per row;
- `quantized_weighted`: a thread block per run of `CHUNK` keys, a thread per output column d, the
  rows' weights of the run in shared memory; each run's sums go out apart and are added by MLX (one
  sum over the runs), so no two blocks write one output.

Elsewhere (and for a shape the kernels do not take: `fits`) `fallback_scores` / `fallback_weighted`
dequantize and multiply with MLX's ops, the arithmetic `tests/test_kv_quant.py` pins in float32;
`benchmarks/gpu/kernel_check.py` pins the kernels to them on the GPU.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available

WARPS = 8  # keys a block of `quantized_scores`
CHUNK = 256  # keys a block of `quantized_weighted`
MAX_ROWS_X_D = 8192  # the query rows staged in shared memory, floats (32 KB)

QTriple = tuple[mx.array, mx.array, mx.array]

# Template constants: D, R, BITS, GS; QT the queries' dtype (the dequantized value is rounded to it).
# The value of element d of a packed row: word d * BITS / 32, shifted by (d * BITS) % 32.
HEADER = """
template <typename St>
__device__ inline size_t relay_at4(const St& st, int b, int h, int l, int c) {
  return (size_t)b * st[0] + (size_t)h * st[1] + (size_t)l * st[2] + (size_t)c * st[3];
}
"""

SCORES_SOURCE = """
  constexpr int VPL = D / 32;                 // values a lane
  constexpr int MASK = (1 << BITS) - 1;
  constexpr int PER_WORD = 32 / BITS;
  const int b = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int L = w_shape[2];
  const int l = blockIdx.x * WARPS_ + warp;
  __shared__ float qs[R * D];
  for (int i = threadIdx.x; i < R * D; i += blockDim.x)
    qs[i] = static_cast<float>(q[relay_at4(q_strides, b, h, i / D, i % D)]);
  __syncthreads();
  if (l >= L) return;
  float v[VPL];
  for (int j = 0; j < VPL; ++j) {
    const int d = lane * VPL + j;
    const uint32_t word = w[relay_at4(w_strides, b, h, l, d / PER_WORD)];
    const float qv = static_cast<float>((word >> ((d % PER_WORD) * BITS)) & MASK);
    const float s = static_cast<float>(scales[relay_at4(scales_strides, b, h, l, d / GS)]);
    const float z = static_cast<float>(biases[relay_at4(biases_strides, b, h, l, d / GS)]);
    v[j] = static_cast<float>(static_cast<QT>(qv * s + z));
  }
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int j = 0; j < VPL; ++j) acc += qs[r * D + lane * VPL + j] * v[j];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
    if (lane == 0) out[(((size_t)b * gridDim.y + h) * R + r) * L + l] = acc;
  }
"""

WEIGHTED_SOURCE = """
  constexpr int MASK = (1 << BITS) - 1;
  constexpr int PER_WORD = 32 / BITS;
  const int b = blockIdx.z, h = blockIdx.y, run = blockIdx.x;
  const int d = threadIdx.x;                  // blockDim.x == D
  const int L = w_shape[2];
  const int l0 = run * CHUNK_;
  const int n = min(CHUNK_, L - l0);
  __shared__ float ps[R * CHUNK_];
  for (int i = threadIdx.x; i < R * n; i += blockDim.x)
    ps[i] = static_cast<float>(p[relay_at4(p_strides, b, h, i / n, l0 + i % n)]);
  __syncthreads();
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int k = 0; k < n; ++k) {
    const int l = l0 + k;
    const uint32_t word = w[relay_at4(w_strides, b, h, l, d / PER_WORD)];
    const float qv = static_cast<float>((word >> ((d % PER_WORD) * BITS)) & MASK);
    const float s = static_cast<float>(scales[relay_at4(scales_strides, b, h, l, d / GS)]);
    const float z = static_cast<float>(biases[relay_at4(biases_strides, b, h, l, d / GS)]);
    const float v = static_cast<float>(static_cast<QT>(qv * s + z));
    for (int r = 0; r < R; ++r) acc[r] += ps[r * n + k] * v;
  }
  const size_t H = gridDim.y, B = gridDim.z;
  for (int r = 0; r < R; ++r) out[((((size_t)run * B + b) * H + h) * R + r) * D + d] = acc[r];
"""


def fits(rows: int, head_dim: int, bits: int, group_size: int) -> bool:
    """Whether the kernels take `rows` query rows a key head of `head_dim` values at `bits` bits in
    groups of `group_size`: whole warps over the values (a thread a value in a block), whole groups,
    the rows (and a run's weights) in shared memory."""
    return (bits in (4, 8) and head_dim % 32 == 0 and head_dim <= 1024 and head_dim % group_size == 0
            and rows * head_dim <= MAX_ROWS_X_D and rows * CHUNK * 4 <= 48 * 1024)


def quantized_scores(q: mx.array, keys: QTriple, bits: int, group_size: int) -> mx.array:
    """`q` [B, Hkv, R, D] times the dequantized keys [B, Hkv, L, D], transposed: [B, Hkv, R, L] float32."""
    B, H, R, D = q.shape
    if not (cuda_kernels_available() and fits(R, D, bits, group_size)):
        return fallback_scores(q, keys, bits, group_size)
    L = keys[0].shape[2]
    kernel = mx.fast.cuda_kernel(name="relay_quantized_scores", input_names=["q", "w", "scales", "biases"],
                                 output_names=["out"], source=SCORES_SOURCE, header=HEADER,
                                 ensure_row_contiguous=False)
    (out,) = kernel(inputs=[q, *keys],
                    template=[("D", D), ("R", R), ("BITS", bits), ("GS", group_size), ("WARPS_", WARPS),
                              ("QT", q.dtype)],
                    grid=(32 * WARPS * -(-L // WARPS), H, B), threadgroup=(32 * WARPS, 1, 1),
                    output_shapes=[(B, H, R, L)], output_dtypes=[mx.float32])
    return out


def quantized_weighted(p: mx.array, values: QTriple, bits: int, group_size: int, dtype: mx.Dtype) -> mx.array:
    """`p` [B, Hkv, R, L] times the dequantized values [B, Hkv, L, D] (rounded to `dtype`): [B, Hkv, R, D] float32."""
    B, H, R, L = p.shape
    D = values[1].shape[-1] * group_size
    if not (cuda_kernels_available() and fits(R, D, bits, group_size)):
        return fallback_weighted(p, values, bits, group_size, dtype)
    runs = -(-L // CHUNK)
    kernel = mx.fast.cuda_kernel(name="relay_quantized_weighted", input_names=["p", "w", "scales", "biases"],
                                 output_names=["out"], source=WEIGHTED_SOURCE, header=HEADER,
                                 ensure_row_contiguous=False)
    (parts,) = kernel(inputs=[p, *values],
                      template=[("D", D), ("R", R), ("BITS", bits), ("GS", group_size), ("CHUNK_", CHUNK),
                                ("QT", dtype)],
                      grid=(D * runs, H, B), threadgroup=(D, 1, 1),
                      output_shapes=[(runs, B, H, R, D)], output_dtypes=[mx.float32])
    return parts.sum(axis=0)


def fallback_scores(q: mx.array, keys: QTriple, bits: int, group_size: int) -> mx.array:
    """The scores through a float copy of the keys (MLX's ops)."""
    k = mx.dequantize(*keys, group_size=group_size, bits=bits).astype(q.dtype)
    return (q @ k.swapaxes(-1, -2)).astype(mx.float32)


def fallback_weighted(p: mx.array, values: QTriple, bits: int, group_size: int, dtype: mx.Dtype) -> mx.array:
    """The weighted values through a float copy of the values (MLX's ops), `p` rounded to `dtype` as
    the product of the copy takes it."""
    v = mx.dequantize(*values, group_size=group_size, bits=bits).astype(dtype)
    return (p.astype(dtype) @ v).astype(mx.float32)

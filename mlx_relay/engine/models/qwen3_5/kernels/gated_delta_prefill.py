"""The GatedDeltaNet recurrence over a prefill chunk (GPU thread only; called from the Qwen3.5
family's prefill, `models/qwen3_5/prefill.py`, between the layer's conv and its gated norm).

    y, state' = delta_rule(q, k, v, a, b, A_log, dt_bias, state, mask)

`q`, `k` [B, T, Hk, Dk] (normalized), `v` [B, T, Hv, Dv], the gates' projections `a`, `b`
[B, T, Hv], the recurrent state [B, Hv, Dv, Dk] before the chunk (float32) and an optional mask
[B, T] (a right-padded row's padding: no decay, no update, output 0). Each value row of each head
is an independent recurrence over the T positions that shares only the head's keys, queries and
gates:

    S_v <- g_t S_v;  S_v <- S_v + k_t (v_t[v] - S_v . k_t) beta_t;  y_t[v] = S_v . q_t

On a CUDA GPU this is one launch (`_CUDA_SOURCE`): a thread block per 32 value rows of a head,
8 lanes per row holding its Dk state columns in registers across all T positions, the head's
keys and queries staged through shared memory 16 positions at a time; T is read from the input's
shape, so a chunk of any length reuses one compiled kernel. It replaces mlx-vlm 0.7.10's chunked
WY form (`gated_delta_chunked`: plain MLX operations with a Python loop over 64-position chunks
and a 64-step triangular solve, about 20 ms a layer for 2,048 positions on an H100), as mlx-lm's
Metal kernel does on Apple GPUs. Elsewhere, and for the speculative verify's per-position states,
it is `fallback`: on the CPU our `gated_delta_cpu.recurrence`, elsewhere the library's own
`gated_delta_update` (the float32 tests pin the prefill that calls it; `benchmarks/gpu/kernel_check.py`
pins the kernel against it on a GPU).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.models.qwen3_5.gated_delta import compute_g, gated_delta_update

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_cpu import recurrence

LANES_PER_ROW = 8  # lanes sharing one value row's state columns
ROWS_PER_BLOCK = 32  # value rows per thread block (256 threads)
TILE = 16  # positions staged in shared memory at a time

CUDA_HEADER = """
__device__ inline float relay_row_sum8(float v) {
  v += __shfl_xor_sync(0xffffffff, v, 1);
  v += __shfl_xor_sync(0xffffffff, v, 2);
  v += __shfl_xor_sync(0xffffffff, v, 4);
  return v;
}
"""

# Template constants: Dk, Dv, Hk, Hv; InT (y) and StT (the state) the outputs' dtypes. __MASK_AT__ reads
# the mask (or is `true` for a kernel without one).
# A lane owns state columns 4 * (lane + 8 j) + c (j < Dk / 32, c < 4): its float4 reads of a staged
# key or query row are contiguous across the row's 8 lanes (no shared-memory bank conflict).
_CUDA_SOURCE = """
  constexpr int LPR = __LPR__;
  constexpr int RPB = __RPB__;
  constexpr int TT = __TILE__;
  constexpr int NV4 = Dk / (4 * LPR);  // float4 groups per lane
  constexpr int NPL = 4 * NV4;         // state columns per lane
  const int T = q_shape[1];
  const int blocks_per_head = Dv / RPB;
  const int n = blockIdx.x / blocks_per_head;  // b * Hv + hv
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);
  const int row0 = (blockIdx.x % blocks_per_head) * RPB;
  const int tid = threadIdx.x;
  const int local = tid / LPR;  // this lane's value row in the block
  const int lane = tid % LPR;
  const int row = row0 + local;

  __shared__ float4 sq[TT][Dk / 4];
  __shared__ float4 sk[TT][Dk / 4];
  __shared__ float sv[TT][RPB];
  __shared__ float sy[TT][RPB];
  __shared__ float sg[TT];
  __shared__ float sb[TT];
  __shared__ bool sm[TT];

  float st[NPL];
  const size_t srow = ((size_t)n * Dv + row) * Dk;
  for (int j = 0; j < NV4; ++j)
    for (int c = 0; c < 4; ++c)
      st[4 * j + c] = static_cast<float>(state_in[srow + 4 * (lane + LPR * j) + c]);

  for (int t0 = 0; t0 < T; t0 += TT) {
    const int nt = min(TT, T - t0);
    for (int i = tid; i < nt * Dk; i += blockDim.x) {
      const int tt = i / Dk, d = i % Dk;
      const size_t at = (((size_t)b * T + t0 + tt) * Hk + hk) * Dk + d;
      reinterpret_cast<float*>(sq[tt])[d] = static_cast<float>(q[at]);
      reinterpret_cast<float*>(sk[tt])[d] = static_cast<float>(k[at]);
    }
    for (int i = tid; i < nt * RPB; i += blockDim.x) {
      const int tt = i / RPB, r = i % RPB;
      sv[tt][r] = static_cast<float>(v[(((size_t)b * T + t0 + tt) * Hv + hv) * Dv + row0 + r]);
    }
    if (tid < nt) {
      const size_t at = ((size_t)b * T + t0 + tid) * Hv + hv;
      sg[tid] = static_cast<float>(g[at]);
      sb[tid] = static_cast<float>(beta[at]);
      sm[tid] = __MASK_AT__;
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      if (!sm[tt]) {
        if (lane == 0) sy[tt][local] = 0.f;
        continue;
      }
      const float gt = sg[tt];
      float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
      for (int j = 0; j < NV4; ++j) {
        const float4 kk = sk[tt][lane + LPR * j];
        float* s = st + 4 * j;
        s[0] *= gt; s[1] *= gt; s[2] *= gt; s[3] *= gt;
        p0 += s[0] * kk.x; p1 += s[1] * kk.y; p2 += s[2] * kk.z; p3 += s[3] * kk.w;
      }
      const float mem = relay_row_sum8((p0 + p1) + (p2 + p3));
      const float delta = (sv[tt][local] - mem) * sb[tt];
      p0 = p1 = p2 = p3 = 0.f;
      for (int j = 0; j < NV4; ++j) {
        const float4 kk = sk[tt][lane + LPR * j];
        const float4 qq = sq[tt][lane + LPR * j];
        float* s = st + 4 * j;
        s[0] += kk.x * delta; s[1] += kk.y * delta; s[2] += kk.z * delta; s[3] += kk.w * delta;
        p0 += s[0] * qq.x; p1 += s[1] * qq.y; p2 += s[2] * qq.z; p3 += s[3] * qq.w;
      }
      const float out = relay_row_sum8((p0 + p1) + (p2 + p3));
      if (lane == 0) sy[tt][local] = out;
    }
    __syncthreads();
    for (int i = tid; i < nt * RPB; i += blockDim.x) {
      const int tt = i / RPB, r = i % RPB;
      y[(((size_t)b * T + t0 + tt) * Hv + hv) * Dv + row0 + r] = static_cast<InT>(sy[tt][r]);
    }
  }
  for (int j = 0; j < NV4; ++j)
    for (int c = 0; c < 4; ++c)
      state_out[srow + 4 * (lane + LPR * j) + c] = static_cast<StT>(st[4 * j + c]);
"""


def cuda_source(has_mask: bool) -> str:
    """The kernel body as MLX compiles it (its constants substituted)."""
    return (_CUDA_SOURCE.replace("__LPR__", str(LANES_PER_ROW)).replace("__RPB__", str(ROWS_PER_BLOCK))
            .replace("__TILE__", str(TILE))
            .replace("__MASK_AT__", "mask[(size_t)b * T + t0 + tid]" if has_mask else "true"))


def kernel_fits(q: mx.array, v: mx.array) -> bool:
    """The shapes the kernel was written for: whole float4 groups per lane, whole blocks of value
    rows per head, a row's state in at most 32 registers per lane."""
    Hk, Dk = q.shape[2], q.shape[3]
    Hv, Dv = v.shape[2], v.shape[3]
    return Dk % (4 * LANES_PER_ROW) == 0 and Dk <= 256 and Dv % ROWS_PER_BLOCK == 0 and Hv % Hk == 0


def delta_rule(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array,
               dt_bias: mx.array, state: mx.array | None, mask: mx.array | None = None,
               state_steps: int | None = None, *, kernel: bool = True) -> Any:
    """See the module docstring. With `state_steps` (a speculative verify keeping the state after
    each position), the library's (y, state, states); else (y, state). `kernel`: the CUDA kernel
    where it runs (off: the library's arithmetic everywhere)."""
    B, _, _, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if kernel and state_steps is None and cuda_kernels_available() and kernel_fits(q, v):
        return cuda_delta_rule(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state, mask)
    return fallback(q, k, v, a, b, A_log, dt_bias, state, mask, state_steps)


def cuda_delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                    mask: mx.array | None) -> tuple[mx.array, mx.array]:
    """The kernel (CUDA only): g [B, T, Hv] and beta [B, T, Hv] already computed."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    has_mask = mask is not None
    inputs = [q, k, v, g, beta, state] + ([mask] if has_mask else [])
    names = ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if has_mask else [])
    kernel = mx.fast.cuda_kernel(name="relay_gated_delta_prefill" + ("_mask" if has_mask else ""),
                                 input_names=names, output_names=["y", "state_out"], source=cuda_source(has_mask),
                                 header=CUDA_HEADER)
    threads = ROWS_PER_BLOCK * LANES_PER_ROW
    y, state_out = kernel(
        inputs=inputs,
        template=[("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("InT", v.dtype), ("StT", state.dtype)],
        grid=(B * Hv * (Dv // ROWS_PER_BLOCK) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape],
        output_dtypes=[v.dtype, state.dtype],
    )
    return y, state_out


def fallback(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array,
             dt_bias: mx.array, state: mx.array, mask: mx.array | None, state_steps: int | None) -> Any:
    """On the CPU `gated_delta_cpu.recurrence` (the library's gates); elsewhere, and for the
    verify's per-position states, the library's `gated_delta_update` (its chunked scan for T > 1
    off Metal, its Metal kernel on Apple GPUs)."""
    if state_steps is None and mx.default_device() == mx.cpu:
        return recurrence(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state, mask)
    return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=state, mask=mask, state_steps=state_steps)

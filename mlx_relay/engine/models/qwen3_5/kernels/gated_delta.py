"""A GatedDeltaNet layer's mixer between its input projections and its output projection, for a
block of T positions (GPU thread only; called from the Qwen3.5 family's layer loop,
`models/qwen3_5/layers.py`, inside the compiled decode step and MTP verify round).

    y, conv', ssm' = gated_delta_mixer(la, qkv, z, b, a, conv, ssm, keep_states=...)

`la` is mlx-vlm's `Qwen3_5GatedDeltaNet` (its weights: the depthwise conv, `A_log`, `dt_bias`, the
gated RMSNorm); `qkv`, `z`, `b`, `a` its four input projections of the block [B, T, ...] (the
kernel reads every input through its strides: views of one merged product, `merged_projections.py`,
are read in place, where MLX would copy each first); `conv`
the conv window [B, K-1, C] and `ssm` the recurrent state [B, Hv, Dv, Dk] before the block. It
returns the gated, normalized output [B, T, Hv*Dv] (what `out_proj` takes) and, per
`models.ModelFamily.forward_block`, the conv window and state after the block, or
(`keep_states`) the whole conv input [B, K-1+T, C] and the state after each position
[B, T, Hv, Dv, Dk].

On a CUDA GPU this is one kernel launch (`CUDA_SOURCE`: one thread block per row and value head;
the head's state rows live in registers across the T positions) where the library runs about
two dozen small operations. Elsewhere it is `fallback_mixer`, the library's own arithmetic: its
float32-accumulated conv, L2 normalization as an RMS norm, `gated_delta_update` and
`Qwen3_5RMSNormGated`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_update, gated_delta_update_with_states

from mlx_relay.engine.kernels.backend import cuda_kernels_available

WARPS = 8  # the kernel's thread block: 8 warps, each owning Dv/8 rows of the head's state

CUDA_HEADER = """
__device__ inline float relay_warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffff, v, offset);
  return v;
}
"""

# Template constants: T, K (conv taps), Hk, Hv, Dk, Dv, KEEP; InT/ConvT/StT the output dtypes.
# NORM_EPS is substituted (a float cannot be a template argument).
CUDA_SOURCE = """
  constexpr int WARPS = __WARPS__;
  constexpr int RPW = Dv / WARPS;
  constexpr int NPL = Dk / 32;
  constexpr int KEY = Hk * Dk;
  constexpr int C = 2 * KEY + Hv * Dv;
  constexpr int W = KEEP ? K - 1 + T : K - 1;
  const int bi = blockIdx.x / Hv;
  const int hv = blockIdx.x % Hv;
  const int hk = hv / (Hv / Hk);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  __shared__ float sq[Dk];
  __shared__ float sk[Dk];
  __shared__ float sv[Dv];
  __shared__ float sy[Dv];
  __shared__ float red[2 * WARPS];

  auto rq_ = [](float x) { return static_cast<float>(static_cast<InT>(x)); };
  // every input is read through its strides (the four projections may be views of one merged product)
  auto at3 = [](const auto& st, int i, int t, int c) {
    return (size_t)i * st[0] + (size_t)t * st[1] + (size_t)c * st[2];
  };
  auto channel = [&](int i) {
    return i < Dk ? hk * Dk + i : (i < 2 * Dk ? KEY + hk * Dk + (i - Dk) : 2 * KEY + hv * Dv + (i - 2 * Dk));
  };
  auto conv_in = [&](int r, int c) {
    return r < K - 1 ? static_cast<float>(conv[at3(conv_strides, bi, r, c)])
                     : static_cast<float>(qkv[at3(qkv_strides, bi, r - (K - 1), c)]);
  };

  float st[RPW][NPL];
  const size_t head = (size_t)bi * Hv + hv;
  for (int r = 0; r < RPW; ++r) {
    const int row = warp + r * WARPS;
    const size_t at = at3(ssm_strides, bi, hv, row);
    for (int i = 0; i < NPL; ++i) st[r][i] = static_cast<float>(ssm[at + (size_t)(lane * NPL + i) * ssm_strides[3]]);
  }
  const float A = expf(static_cast<float>(A_log[(size_t)hv * A_log_strides[0]]));
  const float inv = rsqrtf(static_cast<float>(Dk));

  for (int t = 0; t < T; ++t) {
    for (int i = tid; i < 2 * Dk + Dv; i += blockDim.x) {
      const int c = channel(i);
      float acc = 0.f;
      for (int j = 0; j < K; ++j) acc += conv_in(t + j, c) * static_cast<float>(conv_w[at3(conv_w_strides, c, j, 0)]);
      const float x = rq_(acc);
      const float s = rq_(x * rq_(1.f / (1.f + expf(-x))));
      if (i < Dk) sq[i] = s; else if (i < 2 * Dk) sk[i - Dk] = s; else sv[i - 2 * Dk] = s;
    }
    __syncthreads();
    float pq = 0.f, pk = 0.f;
    for (int i = tid; i < Dk; i += blockDim.x) { pq += sq[i] * sq[i]; pk += sk[i] * sk[i]; }
    pq = relay_warp_sum(pq);
    pk = relay_warp_sum(pk);
    if (lane == 0) { red[warp] = pq; red[WARPS + warp] = pk; }
    __syncthreads();
    float sum_q = 0.f, sum_k = 0.f;
    for (int w = 0; w < WARPS; ++w) { sum_q += red[w]; sum_k += red[WARPS + w]; }
    const float eps_qk = 1e-6f / Dk;
    const float nq = rsqrtf(sum_q / Dk + eps_qk), nk = rsqrtf(sum_k / Dk + eps_qk);
    float qv[NPL], kv[NPL];
    for (int i = 0; i < NPL; ++i) {
      const int d = lane * NPL + i;
      qv[i] = rq_(rq_(sq[d] * nq) * (inv * inv));
      kv[i] = rq_(rq_(sk[d] * nk) * inv);
    }
    const float dt = static_cast<float>(dt_bias[(size_t)hv * dt_bias_strides[0]]);
    const float x = rq_(static_cast<float>(a[at3(a_strides, bi, t, hv)]) + dt);
    const float softplus = x > 20.f ? x : log1pf(expf(x));
    const float g = expf(-A * softplus);
    const float beta = rq_(1.f / (1.f + expf(-static_cast<float>(b[at3(b_strides, bi, t, hv)]))));
    for (int r = 0; r < RPW; ++r) {
      const int row = warp + r * WARPS;
      float mem = 0.f;
      for (int i = 0; i < NPL; ++i) { st[r][i] *= g; mem += st[r][i] * kv[i]; }
      mem = relay_warp_sum(mem);
      const float delta = (sv[row] - mem) * beta;
      float o = 0.f;
      for (int i = 0; i < NPL; ++i) { st[r][i] += kv[i] * delta; o += st[r][i] * qv[i]; }
      o = relay_warp_sum(o);
      if (lane == 0) sy[row] = rq_(o);
      if (KEEP) {
        const size_t base = ((((size_t)bi * T + t) * Hv + hv) * Dv + row) * Dk + lane * NPL;
        for (int i = 0; i < NPL; ++i) ssm_out[base + i] = static_cast<StT>(st[r][i]);
      }
    }
    __syncthreads();
    float py = 0.f;
    for (int i = tid; i < Dv; i += blockDim.x) py += sy[i] * sy[i];
    py = relay_warp_sum(py);
    if (lane == 0) red[warp] = py;
    __syncthreads();
    float sum_y = 0.f;
    for (int w = 0; w < WARPS; ++w) sum_y += red[w];
    const float ny = rsqrtf(sum_y / Dv + __NORM_EPS__f);
    for (int i = tid; i < Dv; i += blockDim.x) {
      const float xn = rq_(rq_(sy[i] * ny) * static_cast<float>(norm_w[(size_t)i * norm_w_strides[0]]));
      const size_t at = ((size_t)bi * T + t) * Hv * Dv + hv * Dv + i;
      const float zz = static_cast<float>(z[at3(z_strides, bi, t, hv * Dv + i)]);
      y[at] = static_cast<InT>(zz / (1.f + expf(-zz)) * xn);
    }
    __syncthreads();
  }
  if (!KEEP) {
    for (int r = 0; r < RPW; ++r) {
      const int row = warp + r * WARPS;
      for (int i = 0; i < NPL; ++i) ssm_out[(head * Dv + row) * Dk + lane * NPL + i] = static_cast<StT>(st[r][i]);
    }
  }
  const bool owns_qk = (hv % (Hv / Hk)) == 0;
  for (int i = tid; i < 2 * Dk + Dv; i += blockDim.x) {
    if (i < 2 * Dk && !owns_qk) continue;
    const int c = channel(i);
    for (int r = 0; r < W; ++r)
      conv_out[((size_t)bi * W + r) * C + c] = static_cast<ConvT>(conv_in((KEEP ? 0 : T) + r, c));
  }
"""


def _kernel_fits(la: Any) -> bool:
    """The shapes the kernel was written for: whole warps over the key width, whole rows per warp,
    a head's state in at most 64 registers per thread."""
    dk, dv = la.head_k_dim, la.head_v_dim
    return (dk % 32 == 0 and dv % WARPS == 0 and dk * dv <= 128 * 128 and la.num_v_heads % la.num_k_heads == 0
            and la.conv1d.weight.ndim == 3 and la.conv1d.weight.shape[-1] == 1)


def gated_delta_mixer(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv: mx.array,
                      ssm: mx.array, *, keep_states: bool) -> tuple[mx.array, mx.array, mx.array]:
    """See the module docstring; the kernel on a CUDA GPU, the library's arithmetic elsewhere."""
    if cuda_kernels_available() and _kernel_fits(la):
        return cuda_mixer(la, qkv, z, b, a, conv, ssm, keep_states=keep_states)
    return fallback_mixer(la, qkv, z, b, a, conv, ssm, keep_states=keep_states)


def cuda_mixer(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv: mx.array, ssm: mx.array,
               *, keep_states: bool) -> tuple[mx.array, mx.array, mx.array]:
    """The fused kernel (CUDA only)."""
    B, T, C = qkv.shape
    Hk, Hv, Dk, Dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    K = la.conv1d.weight.shape[1]
    eps = float(la.norm.eps)
    kernel = mx.fast.cuda_kernel(
        name=f"relay_gated_delta_mixer_s_e{eps:.3e}".replace(".", "p").replace("-", "m").replace("+", ""),
        input_names=["qkv", "z", "b", "a", "conv", "conv_w", "A_log", "dt_bias", "ssm", "norm_w"],
        output_names=["y", "conv_out", "ssm_out"],
        source=CUDA_SOURCE.replace("__WARPS__", str(WARPS)).replace("__NORM_EPS__", repr(eps)),
        header=CUDA_HEADER,
        ensure_row_contiguous=False,
    )
    W = K - 1 + T if keep_states else K - 1
    state_shape = (B, T, Hv, Dv, Dk) if keep_states else (B, Hv, Dv, Dk)
    y, conv_out, ssm_out = kernel(
        inputs=[qkv, z.reshape(B, T, Hv * Dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv), conv, la.conv1d.weight,
                la.A_log, la.dt_bias, ssm, la.norm.weight],
        template=[("T", T), ("K", K), ("Hk", Hk), ("Hv", Hv), ("Dk", Dk), ("Dv", Dv), ("KEEP", keep_states),
                  ("InT", qkv.dtype), ("ConvT", conv.dtype), ("StT", ssm.dtype)],
        grid=(32 * WARPS * B * Hv, 1, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(B, T, Hv * Dv), (B, W, C), state_shape],
        output_dtypes=[qkv.dtype, conv.dtype, ssm.dtype],
    )
    return y, conv_out, ssm_out


def normalize_qk(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    """As the library's GatedDeltaNet: L2 normalization as an RMS norm with epsilon over the width."""
    inv_scale = k.shape[-1] ** -0.5
    eps = 1e-6 / k.shape[-1]
    return (inv_scale**2) * mx.fast.rms_norm(q, None, eps), inv_scale * mx.fast.rms_norm(k, None, eps)


def normalize_joined_qk(qk: mx.array, heads: int) -> tuple[mx.array, mx.array]:
    """`normalize_qk` of the queries and keys side by side, [..., 2 * heads, D] (the queries' heads
    first, as the conv's output holds them): one norm over both, the same arithmetic row by row (a
    chunk's mixer then launches one norm, and copies the strided pair once, where it did each twice)."""
    inv_scale = qk.shape[-1] ** -0.5
    normed = mx.fast.rms_norm(qk, None, 1e-6 / qk.shape[-1])
    return (inv_scale**2) * normed[..., :heads, :], inv_scale * normed[..., heads:, :]


def causal_conv(la: Any, conv_in: mx.array, T: int) -> mx.array:
    """The causal depthwise conv's T outputs over [B, K-1+T, C]; low precision weights accumulate
    in float32 per position, as the library's one-token decode does."""
    weight = la.conv1d.weight  # [C, K, 1]
    if weight.dtype not in (mx.bfloat16, mx.float16):
        return la.conv1d(conv_in)
    K = weight.shape[1]
    w = weight[:, :, 0].T.astype(mx.float32)
    if T == 1:  # the input is the one window
        return mx.sum(conv_in.astype(mx.float32) * w[None], axis=1).astype(conv_in.dtype)[:, None, :]
    outs = [mx.sum(conv_in[:, j:j + K, :].astype(mx.float32) * w[None], axis=1) for j in range(T)]
    return mx.stack(outs, axis=1).astype(conv_in.dtype)


def fallback_mixer(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv: mx.array,
                   ssm: mx.array, *, keep_states: bool) -> tuple[mx.array, mx.array, mx.array]:
    """The library's arithmetic, op by op (every backend)."""
    B, T, _ = qkv.shape
    conv_in = mx.concatenate([conv, qkv], axis=1)
    mixed = nn.silu(causal_conv(la, conv_in, T))
    q, k, v = (t.reshape(B, T, h, d) for t, h, d in zip(
        mx.split(mixed, [la.key_dim, 2 * la.key_dim], -1),
        (la.num_k_heads, la.num_k_heads, la.num_v_heads),
        (la.head_k_dim, la.head_k_dim, la.head_v_dim), strict=True))
    q, k = normalize_qk(q, k)
    if keep_states:
        out, _final, ssm = gated_delta_update_with_states(q, k, v, a, b, la.A_log, la.dt_bias, state=ssm,
                                                          state_steps=T)
    else:
        out, ssm = gated_delta_update(q, k, v, a, b, la.A_log, la.dt_bias, state=ssm)
        conv_in = conv_in[:, T:, :]  # the window after the block
    out = la.norm(out, z.reshape(B, T, -1, la.head_v_dim))
    return out.reshape(B, T, -1), conv_in, ssm

"""The GatedDeltaNet recurrence of a prefill chunk on the CPU (GPU thread only; called by
`gated_delta_prefill.fallback`, under the Qwen3.5 family's prefill).

    y, state' = recurrence(q, k, v, g, beta, state, mask)

The same recurrence as `gated_delta_prefill` (per head, S <- g_t S; S <- S + beta_t (v_t - S k_t)
k_t^T; y_t = S q_t), in the form that is cheapest on the CPU for the chunk's length:
- under `SEQUENTIAL_BELOW` positions, position by position: mlx-vlm's sequential reference
  `gated_delta_ops` (the arithmetic its decode step runs);
- from there, the chunkwise form of flash-linear-attention's `chunk_gated_delta_rule` (scalar
  gates) over blocks of `BLOCK` positions: within a block, with gamma_i the decay from the block's
  start to position i, the updates u solve a unit lower-triangular system
  (I + A) u = beta v - beta gamma k S0^T, A_ij = beta_i (gamma_i / gamma_j) k_i . k_j for j < i,
  inverted by MLX's `linalg.tri_inv` (one LAPACK call over every block and head); the outputs
  are y = (gamma q - M w_k) S0^T + M w_v, M_ij = (gamma_i / gamma_j) q_i . k_j for j <= i, and the
  state S' = gamma_last S0 + sum_j (gamma_last / gamma_j) u_j k_j^T is carried block to block.
mlx-vlm 0.7.10's own chunked scan (`gated_delta_chunked`, what its forward runs off Metal) has this
form over 64-position blocks with the triangular inverse as a 64-step loop of MLX operations, and
pads every chunk to 64 positions. On this 2-core CPU at the embedded models' shapes (4 value heads
of 32 x 32; medians of 7, ms a layer): 8 positions: library 9.4, sequential 0.6, chunkwise 0.8;
16: 9.6 / 1.3 / 0.8; 64: 9.2 / 5.6 / 2.1; 256: 23.0 / 25.2 / 8.0; 2,048: 111 / 217 / 43.6 (blocks
of 32: 49.9, of 64: 62.1). `tests/test_gated_delta_cpu.py` pins both forms against the library's
sequential reference, float32.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_ops

#: chunks shorter than this run position by position (the chunkwise form costs a block's inverse
#: and matmuls whatever the length)
SEQUENTIAL_BELOW = 16
BLOCK = 16  # positions per block of the chunkwise form (16 beat 32 and 64 at every length measured)


def recurrence(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
               mask: mx.array | None) -> tuple[mx.array, mx.array]:
    """q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g and beta [B, T, Hv], state [B, Hv, Dv, Dk] (float32),
    mask [B, T] or None (False: padding, no decay and no update) -> (y [B, T, Hv, Dv], state')."""
    if q.shape[1] < SEQUENTIAL_BELOW:
        return gated_delta_ops(q, k, v, g, beta, state, mask)
    return chunkwise(q, k, v, g, beta, state, mask)


def chunkwise(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
              mask: mx.array | None, block: int = BLOCK) -> tuple[mx.array, mx.array]:
    """The chunkwise form (see the module docstring); `block` positions a block."""
    B, T, Hk = q.shape[:3]
    Hv, Dv = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    if Hv != Hk:
        q, k = mx.repeat(q, Hv // Hk, axis=2), mx.repeat(k, Hv // Hk, axis=2)
    if mask is not None:
        g, beta = mx.where(mask[..., None], g, 1.0), mx.where(mask[..., None], beta, 0.0)
    pad = -T % block
    if pad:
        def padded(x: mx.array, value: float) -> mx.array:
            return mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

        q, k, v, g, beta = padded(q, 0.0), padded(k, 0.0), padded(v, 0.0), padded(g, 1.0), padded(beta, 0.0)
    n = (T + pad) // block

    def vectors(x: mx.array) -> mx.array:  # [B, n*block, Hv, D] -> [B, Hv, n, block, D]
        return x.reshape(B, n, block, Hv, -1).transpose(0, 3, 1, 2, 4).astype(mx.float32)

    def scalars(x: mx.array) -> mx.array:  # [B, n*block, Hv] -> [B, Hv, n, block]
        return x.reshape(B, n, block, Hv).transpose(0, 3, 1, 2).astype(mx.float32)

    qb, kb, vb, bb = vectors(q), vectors(k), vectors(v), scalars(beta)
    # the log of each position's decay from its block's start (a gate that underflowed to 0 stays finite)
    log_gamma = mx.cumsum(mx.log(mx.maximum(scalars(g), 1e-30)), axis=-1)
    causal = mx.tril(mx.ones((block, block), dtype=mx.bool_))
    log_ratio = log_gamma[..., :, None] - log_gamma[..., None, :]  # log(gamma_i / gamma_j)
    ratio = mx.where(causal, mx.exp(mx.where(causal, log_ratio, 0.0)), 0.0)  # for j <= i, else 0
    eye = mx.eye(block, dtype=mx.float32)
    a = bb[..., :, None] * (kb @ kb.swapaxes(-1, -2)) * ratio * (1 - eye)
    inverse = mx.linalg.tri_inv(eye + a, upper=False, stream=mx.cpu)
    gamma = mx.exp(log_gamma)
    w_v = inverse @ (bb[..., None] * vb)  # [B, Hv, n, block, Dv]
    w_k = inverse @ ((bb * gamma)[..., None] * kb)  # [B, Hv, n, block, Dk]
    m = (qb @ kb.swapaxes(-1, -2)) * ratio
    q_state = gamma[..., None] * qb - m @ w_k  # what reads the block's starting state
    y_local = m @ w_v
    to_end = mx.exp(log_gamma[..., -1:] - log_gamma)[..., None]  # gamma_last / gamma_j
    s = state.astype(mx.float32)
    ys = []
    for c in range(n):
        s_t = s.swapaxes(-1, -2)  # [B, Hv, Dk, Dv]
        ys.append(y_local[:, :, c] + q_state[:, :, c] @ s_t)
        u = w_v[:, :, c] - w_k[:, :, c] @ s_t
        s = gamma[:, :, c, -1][..., None, None] * s + (to_end[:, :, c] * u).swapaxes(-1, -2) @ kb[:, :, c]
    y = mx.stack(ys, axis=2).transpose(0, 2, 3, 1, 4).reshape(B, n * block, Hv, Dv)[:, :T]
    return y.astype(out_dtype), s

"""The Qwen3.5 family's GatedDeltaNet mixer over a prefill chunk (GPU thread only; the recurrent layers
of `prefill.prefill_forward` and of the chunk's part of `mixed.mixed_forward`).

Two forms of one arithmetic, mlx-vlm's `Qwen3_5GatedDeltaNet` from its input projections up to its
output projection (the causal depthwise conv, the normed queries and keys, the delta rule, the gated norm):
- `gated_delta_core`: over the library's `ArraysCache`, kept as the library keeps it (its public
  `update_window`, `update_recurrent`, `advance`; a padded batch's mask; a speculative history);
- `gated_delta_chunk`: a pure function of the conv window and the recurrent state, for a chunk
  without padding whose cache records no history, so that it can be compiled
  (`compiled_chunk.py`); its caller keeps the window and state it returns.
`tests/test_prefill_forward.py` and `tests/test_compiled_chunk.py` pin both against the library's
forward (float32).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.kernels.dense import dense
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import causal_conv, normalize_joined_qk
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_prefill import delta_rule
from mlx_relay.engine.models.qwen3_5.layers import gdn_projections


def recurrent_mask(cache: Any, T: int) -> mx.array | None:
    """[B, T]: which positions of a chunk are real (a right-padded row's padding is not, nor a
    left-padded row's), as the library's model asks the recurrent layers' cache; None when the
    cache knows of no padding."""
    if getattr(cache, "left_padding", None) is None and getattr(cache, "lengths", None) is None:
        return None
    mask: mx.array | None = cache.make_mask(T)
    return mask


def gated_delta_net(la: Any, x: mx.array, cache: Any, mask: mx.array | None, options: PrefillOptions) -> mx.array:
    """The library's `Qwen3_5GatedDeltaNet` over a chunk, its conv window and recurrent state in
    `cache` (an `ArraysCache`: [0] the window, [1] the state), kept as the library keeps them."""
    return dense(la.out_proj, gated_delta_core(la, *gdn_projections(la, x), cache, mask, options))


def chunk_window(la: Any, cache: Any, B: int, dtype: mx.Dtype) -> mx.array:
    """The conv window a chunk of `B` rows starts from: the cache's, or zeros (a new prompt)."""
    window = cache[0]
    if window is None or window.shape[0] != B:
        return mx.zeros((B, la.conv_kernel_size - 1, la.conv_dim), dtype=dtype)
    return window


def gated_delta_core(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: Any,
                     mask: mx.array | None, options: PrefillOptions) -> mx.array:
    """`gated_delta_net` from the mixer's projections [B, T, *] up to its output projection: [B, T, Hv * Dv]."""
    B, T, _ = qkv.shape
    width = la.conv_kernel_size - 1
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_in = mx.concatenate([chunk_window(la, cache, B, qkv.dtype), qkv], axis=1)
    cache.update_window(0, conv_in, width, lengths=cache.lengths)
    q, k, v = _conv_heads(la, conv_in, T, options)

    def update(state: mx.array | None, state_steps: int | None) -> Any:
        state = state if state is None or state.shape[0] == B else None
        return delta_rule(q, k, v, a, b, la.A_log, la.dt_bias, state, mask, state_steps,
                          kernel=options.recurrence_kernel)

    out, _ = cache.update_recurrent(1, T, update)
    cache.advance(T)
    return _gated_norm(la, out, z)


def gated_delta_chunk(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, window: mx.array,
                      state: mx.array | None, options: PrefillOptions
                      ) -> tuple[mx.array, mx.array, mx.array]:
    """`gated_delta_core` of a chunk without padding as a pure function: its output [B, T, Hv * Dv],
    the conv window after it (the conv input's last K-1 positions, as the library's `update_window`
    keeps them) and the recurrent state after it."""
    T = qkv.shape[1]
    conv_in = mx.concatenate([window, qkv], axis=1)
    q, k, v = _conv_heads(la, conv_in, T, options)
    out, state = delta_rule(q, k, v, a, b, la.A_log, la.dt_bias, state, None, None, kernel=options.recurrence_kernel)
    return _gated_norm(la, out, z), mx.contiguous(conv_in[:, T:]), state


def _conv_heads(la: Any, conv_in: mx.array, T: int, options: PrefillOptions) -> tuple[mx.array, mx.array, mx.array]:
    """The conv over [B, K-1+T, C], activated and split into normed queries, keys and values per head."""
    B = conv_in.shape[0]
    mixed = nn.silu(depthwise_conv(la, conv_in, T, options.shifted_conv))
    qk, v = mx.split(mixed, [2 * la.key_dim], -1)
    q, k = normalize_joined_qk(qk.reshape(B, T, 2 * la.num_k_heads, la.head_k_dim), la.num_k_heads)
    return q, k, v.reshape(B, T, la.num_v_heads, la.head_v_dim)


def _gated_norm(la: Any, out: mx.array, z: mx.array) -> mx.array:
    """The delta rule's output [B, T, Hv, Dv] through the mixer's gated norm: [B, T, Hv * Dv]."""
    B, T = out.shape[:2]
    return la.norm(out, z.reshape(B, T, -1, la.head_v_dim)).reshape(B, T, -1)


def depthwise_conv(la: Any, conv_in: mx.array, T: int, shifted: bool = True) -> mx.array:
    """The causal depthwise conv's T outputs over [B, K-1+T, C]: on a GPU (and `shifted`), K
    shifted multiply-adds accumulated in float32 (a few elementwise launches, where MLX runs a
    grouped convolution of C groups); elsewhere the library's (its `Conv1d`, or for one bf16 token
    its float32 decode conv)."""
    weight = la.conv1d.weight  # [C, K, 1]
    if T == 1 or not shifted or not cuda_kernels_available():
        return causal_conv(la, conv_in, T) if T == 1 else la.conv1d(conv_in)
    K = weight.shape[1]
    w = weight[:, :, 0].astype(mx.float32)  # [C, K]
    acc = conv_in[:, 0:T, :].astype(mx.float32) * w[:, 0]
    for j in range(1, K):
        acc = acc + conv_in[:, j:j + T, :].astype(mx.float32) * w[:, j]
    return acc.astype(conv_in.dtype)

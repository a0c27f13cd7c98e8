"""A prefill chunk through the Qwen3.5 family's layer loop over the library's own caches (GPU thread
only; `models.ModelFamily.prefill_forward`, called by the lanes' prefill through
`lanes/stage_forward.ModelForward`).

    hidden = prefill_forward(lm, ids, embeds, caches, positions, options)   # [B, T, H], final-normed

What mlx-vlm's language model computes for the chunk (`lm(ids, inputs_embeds=..., cache=...,
position_ids=...)`, its batched path), with the same caches kept the same way through their
public API (`BatchKVCache` / `KVCache.update_and_fetch` and `make_mask`; `ArraysCache`'s
`update_window`, `update_recurrent`, `advance`, `make_mask`), but with the parts that are slow on a
GPU done otherwise:
- the GatedDeltaNet recurrence: one kernel launch per layer (`kernels.gated_delta_prefill`) where
  the library runs its chunked scan; its causal depthwise conv as K shifted multiply-adds
  accumulated in float32 on a GPU (`depthwise_conv`; the library's grouped `Conv1d` elsewhere);
- the mixture of experts: grouped GEMMs over the sorted (token, expert) pairs
  (`kernels.grouped_experts`) where MLX's CUDA backend runs one matmul per pair;
- attention: the library's projections, norms and rotary embedding, then MLX's attention over
  blocks of at most `PrefillOptions.attention_rows` queries, each against the keys up to its last
  position (causal: no block reads a later key), so a long context's scores (MLX's CUDA backend
  has no fused attention for head dim 256: it materializes them) stay within a bound instead of
  growing with chunk x context (`models/attention.py`, `models/prefill_options.py`). A chunk whose rows carry no left
  padding is masked causally by the attention itself (no mask array of chunk x context).

On a GPU the chunk's layers are queued one ahead of the device (`chunk_forward.pacing`): its transient
memory is at most two layers', not the chunk's. Each lever can be turned off (`PrefillOptions`: that part
then runs the library's arithmetic; `benchmarks/prefill_parts.py` measures what each buys). Off a
GPU every part is the library's own arithmetic (`tests/test_prefill_forward.py` pins the chunk's
hidden states and caches against the library's forward, float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.language import apply_multimodal_rotary_pos_emb

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.attention import attend_cache, attention_mask
from mlx_relay.engine.models.chunk_forward import pacing
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import causal_conv, normalize_qk
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_prefill import delta_rule
from mlx_relay.engine.models.qwen3_5.layers import gated_output, gdn_projections, project_qkv, run_layers


def prefill_forward(lm: Any, ids: mx.array, embeds: mx.array | None, caches: list[Any], positions: mx.array,
                    options: PrefillOptions, after: Callable[[mx.array], None] | None = None) -> mx.array:
    """`models.ModelFamily.prefill_forward`: see the module docstring. `positions` [3, B, T] (M-RoPE);
    `after`, the caller's hook after each layer (in place of `chunk_forward.pacing`'s)."""
    model = lm.model
    h = embeds if embeds is not None else model.embed_tokens(ids)
    T = h.shape[1]
    attn_mask = attention_mask(caches[model.fa_idx], T)
    ssm_mask = recurrent_mask(caches[model.ssm_idx], T)
    rotary = position_embeddings(model.layers, h, positions)
    cache_of = iter(caches)  # one per layer, in layer order: the mixers take theirs as they run

    def linear(la: Any, x: mx.array) -> mx.array:
        return gated_delta_net(la, x, next(cache_of), ssm_mask, options)

    def attend(sa: Any, x: mx.array) -> mx.array:
        return attention(sa, x, next(cache_of), positions, rotary, attn_mask, options)

    return model.norm(run_layers(model.layers, h, linear, attend, prefill=options, after=pacing(options, after)))


def recurrent_mask(cache: Any, T: int) -> mx.array | None:
    """[B, T]: which positions of a chunk are real (a right-padded row's padding is not, nor a
    left-padded row's), as the library's model asks the recurrent layers' cache; None when the
    cache knows of no padding."""
    if getattr(cache, "left_padding", None) is None and getattr(cache, "lengths", None) is None:
        return None
    mask: mx.array | None = cache.make_mask(T)
    return mask


def position_embeddings(layers: list[Any], h: mx.array, positions: mx.array) -> Any:
    """As the library's model: the rotary embedding's (cos, sin) computed once for the chunk, or
    None where its attention layers apply it themselves (`fused_apply`)."""
    sa = next((layer.self_attn for layer in layers if not layer.is_linear), None)
    if sa is None or sa.rotary_emb.fused_apply:
        return None
    return sa.rotary_emb(h, positions)


def attention(sa: Any, x: mx.array, cache: Any, positions: mx.array, rotary: Any, mask: Any,
              options: PrefillOptions) -> mx.array:
    """The library's gated attention over its KV cache, the scores in blocks of queries."""
    queries, keys, values, gate = project_qkv(sa, x)
    return gated_output(sa, attend_cached(sa, queries, keys, values, cache, positions, rotary, mask, options), gate)


def attend_cached(sa: Any, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, positions: mx.array,
                  rotary: Any, mask: Any, options: PrefillOptions) -> mx.array:
    """Queries, keys and values [B, heads, T, D] rotated to `positions`, the keys and values into the
    library's KV cache: the attention's output [B, heads, T, D], its scores in blocks of queries."""
    if rotary is None:
        queries, keys = sa.rotary_emb.apply_rotary(queries, keys, positions, unsqueeze_dim=1)
    else:
        queries, keys = apply_multimodal_rotary_pos_emb(queries, keys, *rotary)
    return attend_cache(queries, keys, values, cache, sa.scale, mask, options)


def gated_delta_net(la: Any, x: mx.array, cache: Any, mask: mx.array | None, options: PrefillOptions) -> mx.array:
    """The library's `Qwen3_5GatedDeltaNet` over a chunk, its conv window and recurrent state in
    `cache` (an `ArraysCache`: [0] the window, [1] the state), kept as the library keeps them."""
    return la.out_proj(gated_delta_core(la, *gdn_projections(la, x), cache, mask, options))


def gated_delta_core(la: Any, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, cache: Any,
                     mask: mx.array | None, options: PrefillOptions) -> mx.array:
    """`gated_delta_net` from the mixer's projections [B, T, *] up to its output projection: [B, T, Hv * Dv]."""
    B, T, _ = qkv.shape
    width = la.conv_kernel_size - 1
    window = cache[0]
    if window is None or window.shape[0] != B:
        window = mx.zeros((B, width, la.conv_dim), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_in = mx.concatenate([window, qkv], axis=1)
    cache.update_window(0, conv_in, width, lengths=cache.lengths)
    mixed = nn.silu(depthwise_conv(la, conv_in, T, options.shifted_conv))
    q, k, v = (t.reshape(B, T, heads, dim) for t, heads, dim in zip(
        mx.split(mixed, [la.key_dim, 2 * la.key_dim], -1),
        (la.num_k_heads, la.num_k_heads, la.num_v_heads),
        (la.head_k_dim, la.head_k_dim, la.head_v_dim), strict=True))
    q, k = normalize_qk(q, k)

    def update(state: mx.array | None, state_steps: int | None) -> Any:
        state = state if state is None or state.shape[0] == B else None
        return delta_rule(q, k, v, a, b, la.A_log, la.dt_bias, state, mask, state_steps,
                          kernel=options.recurrence_kernel)

    out, _ = cache.update_recurrent(1, T, update)
    cache.advance(T)
    out = la.norm(out, z.reshape(B, T, -1, la.head_v_dim))
    return out.reshape(B, T, -1)


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

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
  accumulated in float32 on a GPU (`chunk_mixer.depthwise_conv`; the library's grouped `Conv1d` elsewhere);
- the mixture of experts: grouped GEMMs over the sorted (token, expert) pairs
  (`kernels.grouped_experts`) where MLX's CUDA backend runs one matmul per pair;
- attention: the library's projections, norms and rotary embedding, then MLX's attention over
  blocks of at most `PrefillOptions.attention_rows` queries, each against the keys up to its last
  position (causal: no block reads a later key), so a long context's scores (MLX's CUDA backend
  has no fused attention for head dim 256: it materializes them) stay within a bound instead of
  growing with chunk x context (`models/attention.py`, `models/prefill_options.py`). A chunk whose rows carry no left
  padding is masked causally by the attention itself (no mask array of chunk x context).

A small chunk without padding runs its recurrent mixers and its MLPs compiled per layer where the
options say so (`compiled_chunk`: on a CUDA GPU, where the host's graph building outlasts the
device's work). On a GPU the chunk's layers are queued one ahead of the device (`chunk_forward.pacing`): its transient
memory is at most two layers', not the chunk's. Each lever can be turned off (`PrefillOptions`: that part
then runs the library's arithmetic; `benchmarks/prefill_parts.py` measures what each buys). Off a
GPU every part is the library's own arithmetic (`tests/test_prefill_forward.py` pins the chunk's
hidden states and caches against the library's forward, float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_vlm.models.qwen3_5.language import apply_multimodal_rotary_pos_emb

from mlx_relay.engine.models.attention import attend_cache, attention_mask
from mlx_relay.engine.models.chunk_forward import pacing
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.chunk_mixer import gated_delta_net, recurrent_mask
from mlx_relay.engine.models.qwen3_5.compiled_chunk import compiled_linear, compiled_residual, compiled_route
from mlx_relay.engine.models.qwen3_5.layers import gated_output, project_qkv, run_layers


def prefill_forward(lm: Any, ids: mx.array, embeds: mx.array | None, caches: list[Any], positions: mx.array,
                    options: PrefillOptions, after: Callable[[mx.array], None] | None = None,
                    parts: CompiledParts | None = None, *, normed: bool = True) -> mx.array:
    """`models.ModelFamily.prefill_forward`: see the module docstring. `positions` [3, B, T] (M-RoPE);
    `after`, the caller's hook after each layer (in place of `chunk_forward.pacing`'s); `parts`, where a
    small chunk's layers run compiled per part (`compiled_chunk`); `normed` False: before the final norm."""
    model = lm.model
    h = embeds if embeds is not None else model.embed_tokens(ids)
    T = h.shape[1]
    attn_mask = attention_mask(caches[model.fa_idx], T)
    ssm_mask = recurrent_mask(caches[model.ssm_idx], T)
    rotary = position_embeddings(model.layers, h, positions)
    cache_of = iter(caches)  # one per layer, in layer order: the mixers take theirs as they run
    compiled = compiled_route(parts, options, caches, T, padded(attn_mask, ssm_mask))

    def linear(la: Any, x: mx.array) -> mx.array:
        if compiled is not None:
            return compiled_linear(compiled, la, x, next(cache_of), options)[0]
        return gated_delta_net(la, x, next(cache_of), ssm_mask, options)

    def attend(sa: Any, x: mx.array) -> mx.array:
        return attention(sa, x, next(cache_of), positions, rotary, attn_mask, options)

    h = run_layers(model.layers, h, linear, attend, prefill=options, after=pacing(options, after),
                   residual=None if compiled is None else compiled_residual(compiled, options))
    return model.norm(h) if normed else h


def padded(attn_mask: Any, ssm_mask: mx.array | None) -> bool:
    """Whether a chunk's masks say a row of it is padded (its attention's is an array, or its recurrence has one)."""
    return ssm_mask is not None or isinstance(attn_mask, mx.array)


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

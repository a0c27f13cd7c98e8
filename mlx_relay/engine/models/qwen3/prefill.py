"""A prefill chunk through the dense Qwen3 family's layer loop over the engine's caches (GPU thread
only; `models.ModelFamily.prefill_forward`, called by the lanes' prefill through
`lanes/stage_forward.ModelForward`).

    hidden = prefill_forward(lm, ids, embeds, caches, positions, options)   # [B, T, H], final-normed

What mlx-lm's qwen3 model computes for the chunk (`lm.model(ids, cache=...)`, its hidden states),
with its modules and weights. The caches are mlx-vlm's `KVCache` / `BatchKVCache` (`family.make_caches`),
the classes the engine moves rows in and out of (`memory/batch_caches.py`, `lanes/decode_state.py`,
`memory/snapshots.py`): this forward keeps them through their public API (`update_and_fetch`,
`make_mask`, and the plain lane's `prepare` / `finalize` around a ragged chunk), never through
the model's, so the library that made the layers need not be the one that made the caches.
Positions are explicit (`positions[0]`, the text positions of the M-RoPE triples the lanes pass):
each position is rotated at its own offset (`layers.rotate_positions`), so a restored row, a
chunk's right padding or a SpecPrefill row's kept tokens at their original positions need no state
in the caches beyond their keys. Attention runs as every family's does (`models/attention.py`:
in blocks of queries within `PrefillOptions`' bound, masked causally by the attention itself unless
a row carries left padding); on a GPU the layers are paced one ahead (`chunk_forward.pacing`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.engine.models.attention import attend_cache, attention_mask
from mlx_relay.engine.models.chunk_forward import pacing
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3.layers import merged, qkv_heads, qkv_projections, rotate_positions, run_layers


def prefill_forward(lm: Any, ids: mx.array, embeds: mx.array | None, caches: list[Any], positions: mx.array,
                    options: PrefillOptions, after: Callable[[mx.array], None] | None = None, *,
                    normed: bool = True) -> mx.array:
    """`models.ModelFamily.prefill_forward`: see the module docstring. `positions` [3, B, T] (M-RoPE
    shaped; the first section's are the text positions); `after`, the caller's hook after each layer;
    `normed` False: before the final norm."""
    model = lm.model
    h = embeds if embeds is not None else model.embed_tokens(ids)
    mask = attention_mask(caches[0], h.shape[1])
    text = positions[0]
    cache_of = iter(caches)  # one per layer, in layer order

    def attend(sa: Any, x: mx.array) -> mx.array:
        queries, keys, values = qkv_heads(sa, *qkv_projections(sa, x))
        return sa.o_proj(merged(attend_cached(sa, queries, keys, values, next(cache_of), text, mask, options)))

    h = run_layers(model.layers, h, attend, after=pacing(options, after))
    return model.norm(h) if normed else h


def attend_cached(sa: Any, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, positions: mx.array,
                  mask: Any, options: PrefillOptions) -> mx.array:
    """Queries, keys and values [B, T, heads, D] rotated to `positions` [B, T], the keys and values
    into the library's KV cache: the attention's output [B, heads, T, D]."""
    return attend_cache(rotate_positions(sa, queries, positions), rotate_positions(sa, keys, positions),
                        values.transpose(0, 2, 1, 3), cache, sa.scale, mask, options)

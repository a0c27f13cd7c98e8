"""Attention as every family's forwards run it, once its queries and keys are rotated (GPU thread
only): the families' own code projects, norms and rotates (each its library's way), then calls
one of these two, so the caches are kept one way for all of them.

- Over explicit buffers (`attend_buffers`: the decode step, the MTP verify and head,
  `models.ModelFamily.forward_block`): keys and values written where `Positions` says, the
  queries attending to the buffers under its mask.
- Over the library's KV caches (`attend_cache`: a prefill chunk, `models.ModelFamily.prefill_forward`
  and the chunk's part of `mixed_forward`): keys and values through the cache's public
  `update_and_fetch`, the scores in blocks of at most `PrefillOptions.attention_rows` queries, each
  against the keys up to its last position (`blocked_attention`), masked causally by the attention
  itself unless a row carries left padding (`attention_mask`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.models.kv_quant import Buffer, attend, each, first
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions


def attend_buffers(queries: mx.array, keys: mx.array, values: mx.array, keys_buf: Buffer, values_buf: Buffer,
                   at: Positions, scale: float) -> tuple[mx.array, Buffer, Buffer]:
    """Queries, keys and values [B, heads, T, D] (rotated), the keys and values written where `at`
    says (quantized where the buffers are: `kv_quant`): the attention's output [B, heads, T, D] and
    the buffers after."""
    keys_buf = at.write(keys_buf, keys)
    values_buf = at.write(values_buf, values)
    return attend(queries, keys_buf, values_buf, scale, at.mask), keys_buf, values_buf


def attention_mask(cache: Any, T: int) -> Any:
    """The attention mask of a T-token chunk: "causal" (the attention masks it itself, aligned to
    the last key) unless a row of the batch carries left padding, then the cache's own mask array."""
    left = getattr(cache, "left_padding", None)
    if isinstance(left, mx.array) and left.size and int(left.max().item()) > 0:
        return cache.make_mask(T)
    return "causal" if T > 1 else None


def attend_cache(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                 options: PrefillOptions) -> mx.array:
    """Queries, keys and values [B, heads, T, D] (rotated), the keys and values into the library's
    KV cache: the attention's output [B, heads, T, D], its scores in blocks of queries."""
    keys, values = cache.update_and_fetch(keys, values)
    B, heads, _, _ = queries.shape
    max_rows = options.attention_rows(B, heads, first(keys).shape[2], queries.dtype.size)
    return blocked_attention(queries, keys, values, scale, mask, max_rows)


def blocked_attention(q: mx.array, k: Buffer, v: Buffer, scale: float, mask: Any, max_rows: int) -> mx.array:
    """The attention of q [B, heads, T, D] (the last T positions of the S keys) over k, v
    [B, kv heads, S, D] (either form, `kv_quant.attend`), in blocks of at most `max_rows` queries, each
    against the keys up to its own last position. `mask`: None (a single query), "causal", or an
    array [B, 1, T, S]."""
    T, S = q.shape[2], first(k).shape[2]
    if T <= max_rows:
        return attend(q, k, v, scale, mask)
    blocks = []
    for start in range(0, T, max_rows):
        stop = min(T, start + max_rows)
        keys_end = S - T + stop
        block_mask = mask if mask is None or isinstance(mask, str) else mask[..., start:stop, :keys_end]
        upto = lambda x, end=keys_end: x[:, :, :end]  # noqa: E731
        blocks.append(attend(q[:, :, start:stop], each(upto, k), each(upto, v), scale, block_mask))
    return mx.concatenate(blocks, axis=2)

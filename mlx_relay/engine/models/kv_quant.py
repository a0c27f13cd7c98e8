"""Quantized attention keys and values (issue 47.2; GPU thread only): the form one attention layer's
keys or values take when the KV cache is quantized, and the few operations every holder of them
needs, for the explicit buffers (`lanes.decode_state.DecodeState`, `attention.attend_buffers`) and the
library's quantized caches alike.

A float buffer is an array [B, heads, S, D]; a quantized one is MLX's `mx.quantize` triple over its
last axis, `(packed [B, heads, S, D * bits / 32] uint32, scales [B, heads, S, D / group], biases
[B, heads, S, D / group])`, exactly what mlx-vlm's `QuantizedKVCache` / `BatchQuantizedKVCache` keep
and return. The three share the first three axes, so whatever a holder does along the batch or
sequence axis (grow, shift, gather rows, slice columns, concatenate) it does to each part alike
(`each`). The recurrent layers' states never take this form. Attention over a quantized buffer is
the library's quantized path (mlx-vlm's `quantized_scaled_dot_product_attention`: MLX's
`quantized_matmul` for the scores and for the values), except on a CUDA GPU: there MLX 0.32.4's
`quantized_matmul` has no kernel for most context lengths (an H200 at `7a1a1bb`: "[quantized_matmul] No
implementation for problem shape: 16x16x256x16", M x N x K x B with N the keys, for a 16-token prompt's
first chunk, a 1-token one, 63 keys: `benchmarks/results/gpu-h200-2026-11-29d/`), so the keys and values
are dequantized there for MLX's attention: the cache stays quantized in memory, and each attention reads
it and writes a float copy of one layer's, or, past `DEQUANTIZED_BLOCK_BYTES`, runs block by block
(`blockwise_attention`), each block's two products reading the quantized keys and values in place
(`kernels/quantized_attention.py`; where they dequantized each block to a float copy, 16 rows at 128K
tokens held 12.5-13.7 GB of such copies queued ahead of an H200 at `4d39e80`, ~18 GB of whole copies at
`bd632f4`: `benchmarks/results/gpu-h200-2026-11-29e/`, `-29f/`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import mlx.core as mx
from mlx_vlm.models.base import quantized_scaled_dot_product_attention
from mlx_vlm.models.cache import KVCache, QuantizedKVCache

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.kernels.quantized_attention import fits, quantized_scores, quantized_weighted
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.prefill_options import SCORE_COPIES

#: the float copy of the keys and values that a dequantized attention holds at once, at most (longer
#: contexts attend block by block: `blockwise_attention`)
DEQUANTIZED_BLOCK_BYTES = 512 << 20

#: one attention layer's keys (or values): an array, or MLX's quantized triple (packed, scales, biases)
Buffer = Union[mx.array, tuple[mx.array, mx.array, mx.array]]  # noqa: UP007 (a runtime alias)

def is_quantized(buf: Buffer) -> bool:
    return isinstance(buf, tuple)


def each(fn: Callable[[mx.array], mx.array], *bufs: Buffer) -> Buffer:
    """`fn` over the buffers' parts, part by part (an array: itself), as one buffer of the same form."""
    if not is_quantized(bufs[0]):
        return fn(*bufs)
    return tuple(fn(*parts) for parts in zip(*bufs, strict=True))  # type: ignore[return-value]


def first(buf: Buffer) -> mx.array:
    """The array whose first three axes are the buffer's [B, heads, S] (a quantized one's packed part)."""
    return buf[0] if is_quantized(buf) else buf  # type: ignore[return-value]


def quantize(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    packed, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return packed, scales, biases


def layout(buf: tuple[mx.array, ...], head_dim: int) -> tuple[int, int]:
    """(group size, bits) of a quantized buffer of heads of `head_dim` values, from its parts' widths."""
    packed, scales = buf[0], buf[1]
    return head_dim // scales.shape[-1], packed.shape[-1] * 32 // head_dim


def nbytes(buf: Buffer) -> int:
    return sum(x.nbytes for x in buf) if is_quantized(buf) else buf.nbytes  # type: ignore[union-attr]


def attend(queries: mx.array, keys: Buffer, values: Buffer, scale: float, mask: Any, *,
           dequantize: bool | None = None) -> mx.array:
    """The attention of `queries` [B, heads, T, D] over keys and values of either form: MLX's fused
    attention over float ones, the library's quantized path over quantized ones, or (`dequantize`;
    None: on a CUDA GPU, see the module docstring) MLX's over their dequantized copies."""
    if not is_quantized(keys):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    group_size, bits = layout(keys, queries.shape[-1])  # type: ignore[arg-type]
    if cuda_kernels_available() if dequantize is None else dequantize:
        B, kv_heads, S, _ = first(keys).shape
        block = dequantized_block(B, kv_heads, queries.shape[-1], queries.dtype.size)
        if block >= S:
            keys, values = (mx.dequantize(*buf, group_size=group_size, bits=bits).astype(queries.dtype)
                            for buf in (keys, values))  # type: ignore[misc]
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        rows = queries.shape[1] // kv_heads * queries.shape[2]
        if cuda_kernels_available() and fits(rows, queries.shape[-1], bits, group_size):
            block = max(block, scores_block(B, queries.shape[1], queries.shape[2]))  # no float copy: the scores
        return blockwise_attention(queries, keys, values, scale, mask, group_size, bits, block)  # type: ignore[arg-type]
    # the library scales its `queries` argument in place (`queries *= scale`): it gets a scaled copy
    # and a scale of one, so the caller's queries stay as they were
    out: mx.array = quantized_scaled_dot_product_attention(queries * scale, keys, values, scale=1.0, mask=mask,
                                                           group_size=group_size, bits=bits)
    return out


def dequantized_block(rows: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """The most keys whose dequantized keys and values (every row's and head's, `itemsize` bytes a
    value) fit `DEQUANTIZED_BLOCK_BYTES`: a multiple of 256, at least 256."""
    return _keys_fitting(2 * rows * kv_heads * head_dim * itemsize)


def scores_block(rows: int, heads: int, positions: int) -> int:
    """The most keys whose float32 scores (and the softmax's copies of them, `SCORE_COPIES`) for
    `rows` rows of `heads` query heads at `positions` positions fit `DEQUANTIZED_BLOCK_BYTES`: a
    multiple of 256, at least 256 (the block of an attention whose products read the quantized
    keys and values in place, `kernels/quantized_attention.py`)."""
    return _keys_fitting(SCORE_COPIES * rows * heads * positions * 4)


def _keys_fitting(per_key: int) -> int:
    """The most keys of `per_key` bytes that fit `DEQUANTIZED_BLOCK_BYTES`: a multiple of 256, at least 256."""
    return max(256, DEQUANTIZED_BLOCK_BYTES // per_key // 256 * 256)


def blockwise_attention(queries: mx.array, keys: tuple[mx.array, ...], values: tuple[mx.array, ...], scale: float,
                        mask: Any, group_size: int, bits: int, block: int) -> mx.array:
    """The attention of `queries` [B, heads, T, D] (the last T of the S positions) over quantized keys
    and values [B, kv heads, S, D], `block` keys at a time with the softmax merged across the blocks
    (running maximum and sum, in float32): each block's two products through
    `kernels/quantized_attention.py` (on a CUDA GPU they read the quantized keys and values in place;
    elsewhere, and for shapes they do not take, a float copy of the block's), so the float copy held at
    once is at most one block's, not the whole context's. `mask`: None, "causal", or an array
    [B, 1 or heads, T, S] (boolean: attend where true; else added to the scores)."""
    B, heads, T, D = queries.shape
    kv_heads, S = keys[0].shape[1], keys[0].shape[2]
    rep = heads // kv_heads
    # query heads grouped by their key head, as rows of one product a key head (no broadcast copies)
    q = (queries * scale).reshape(B, kv_heads, rep * T, D)
    floor = mx.array(-1e30, dtype=mx.float32)
    high = total = out = None
    for start in range(0, S, block):
        stop = min(S, start + block)
        k, v = (tuple(x[:, :, start:stop] for x in buf) for buf in (keys, values))
        scores = quantized_scores(q, k, bits, group_size).reshape(B, kv_heads, rep, T, stop - start)
        if isinstance(mask, str):  # causal: query t sees the keys up to S - T + t
            keep = mx.arange(start, stop)[None] <= (S - T + mx.arange(T))[:, None]
            scores = mx.where(keep, scores, floor)
        elif mask is not None:
            m = mask[..., start:stop]
            grouped = (1, 1) if m.shape[1] == 1 else (kv_heads, rep)
            m = m.reshape(m.shape[0], *grouped, m.shape[2], stop - start)
            scores = mx.where(m, scores, floor) if m.dtype == mx.bool_ else scores + m.astype(mx.float32)
        scores = scores.reshape(B, kv_heads, rep * T, stop - start)
        top = scores.max(axis=-1, keepdims=True)
        high_new = top if high is None else mx.maximum(high, top)
        p = mx.exp(scores - high_new)
        part = quantized_weighted(p, v, bits, group_size, queries.dtype)
        if high is None:
            total, out = p.sum(axis=-1, keepdims=True), part
        else:
            decay = mx.exp(high - high_new)
            total = total * decay + p.sum(axis=-1, keepdims=True)
            out = out * decay + part
        high = high_new
    assert out is not None and total is not None
    return (out / total).astype(queries.dtype).reshape(B, heads, T, D)


def head_dim(lm: Any) -> int:
    """The values a head of `lm`'s attention holds (its config's, or hidden size over heads)."""
    args = lm.args
    return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)


def fresh_caches(lm: Any, caches: list[Any], quant: KVQuant | None) -> list[Any]:
    """A row's fresh library caches (as its family makes them) with, where `quant` says, each
    attention layer's `KVCache` a `QuantizedKVCache` of its bits (the recurrent layers' as they are)."""
    if quant is None:
        return caches

    group = KVQuant.group_for(head_dim(lm))
    return [QuantizedKVCache(group_size=group, bits=quant.bits) if type(c) is KVCache else c for c in caches]

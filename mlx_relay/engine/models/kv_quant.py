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
it and writes a float copy of one layer's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import mlx.core as mx
from mlx_vlm.models.base import quantized_scaled_dot_product_attention
from mlx_vlm.models.cache import KVCache, QuantizedKVCache

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.kv_format import KVQuant

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
        keys, values = (mx.dequantize(*buf, group_size=group_size, bits=bits).astype(queries.dtype)
                        for buf in (keys, values))  # type: ignore[misc]
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    # the library scales its `queries` argument in place (`queries *= scale`): it gets a scaled copy
    # and a scale of one, so the caller's queries stay as they were
    out: mx.array = quantized_scaled_dot_product_attention(queries * scale, keys, values, scale=1.0, mask=mask,
                                                           group_size=group_size, bits=bits)
    return out


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

"""Row operations on a batch's caches (GPU thread only), through the cache classes' public API.

A batch of rows keeps one cache object per layer: mlx-vlm's `BatchKVCache` (attention: keys
left-padded to the longest row, each row's padding masked; `BatchQuantizedKVCache` where the KV
cache is quantized, `models.kv_quant`) and `ArraysCache` (GatedDeltaNet:
conv and recurrent state, one slice per row). Rows move between batches (a prefill chunk's rows
joining the decode batch, a row leaving) with the operations below, and every forward over such
caches asks for one batched call (`batched`); `tests/test_library_adapters.py` pins what they
rely on.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache, BatchKVCache, BatchQuantizedKVCache, KVCache, QuantizedKVCache

from mlx_relay.engine.models.kv_quant import each


def batched(**kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for a forward over batch caches that must run as ONE batch.

    mlx-vlm's qwen3_5 model runs a batch row by row (extracting each row's caches, running it,
    merging them back: copies, and a host sync per call) when it is a single row, or when its
    KV caches carry left padding and the call feeds more than one token, unless the call asks
    for captured hidden states; asking for none (`capture_layer_ids=[]`, a public argument)
    keeps the one batched forward, whose masks handle the padding (pinned by
    tests/test_library_adapters.py)."""
    return {"capture_layer_ids": [], **kwargs}


def as_batch_caches(caches: list[Any]) -> list[Any]:
    """A batch-1 cache (a row restored or not started) as batch caches (each class's public
    `merge`). Our rows never carry left padding in their recurrent state (only their keys are
    left-padded), so an `ArraysCache` merged from an empty cache drops the zero `left_padding`
    `merge` gives it: with one, mlx-vlm's model ignores the per-row `lengths` of a right-padded
    chunk and lets the padding into the state."""
    out: list[Any] = []
    for c in caches:
        if isinstance(c, KVCache):
            out.append(BatchKVCache.merge([c]))
        elif isinstance(c, QuantizedKVCache):  # (no `merge` of its own: one row through its public state)
            batch = BatchQuantizedKVCache([0], group_size=c.group_size, bits=c.bits)
            if c.keys is not None:
                keys, values = c.state
                batch.state = (keys, values, mx.array([c.offset]), mx.array([0]))
            out.append(batch)
        else:
            merged = ArraysCache.merge([c])
            merged.left_padding = None
            out.append(merged)
    return out


def extend_caches(mine: list[Any], theirs: list[Any]) -> None:
    """Append `theirs`' rows to `mine`, layer by layer (in place), keeping the keys' dtype.

    mlx-vlm 0.7.10's `BatchKVCache.extend` gives a side without keys (a row joining a prefill
    batch before its first chunk) an empty `mx.array([])`, float32, so concatenating it turned the
    whole batch's bfloat16 keys and values into float32: twice the memory, and attention, then the
    residual stream of every layer after it, computed in float32 from then on (a pipeline's ranks
    then disagreed on the dtype crossing a stage boundary: a broken NCCL collective on two GPUs).
    Cast back to the dtype the keys had (the float32 copy holds the bfloat16 values exactly, and
    the padding is zeros); pinned by tests/test_library_adapters.py."""
    for a, b in zip(mine, theirs, strict=True):
        had = _kv_dtype(a) or _kv_dtype(b)
        a.extend(b)
        if had is not None and isinstance(a, BatchKVCache) and a.keys is not None and a.keys.dtype != had:
            a.keys, a.values = a.keys.astype(had), a.values.astype(had)


def _kv_dtype(cache: Any) -> Any:
    """The dtype of a batch KV cache's keys; None for another cache or one without keys."""
    return cache.keys.dtype if isinstance(cache, BatchKVCache) and cache.keys is not None else None


def take_rows(caches: list[Any], rows: list[int]) -> list[Any]:
    """New batch caches holding only `rows` of `caches` (one gather per array; the source is
    left as it was)."""
    idx = mx.array(rows, dtype=mx.int32)
    out: list[Any] = []
    for c in caches:
        if isinstance(c, (BatchKVCache, BatchQuantizedKVCache)):
            keys, values, offset, left_padding = c.state
            taken = (BatchKVCache([0] * len(rows)) if isinstance(c, BatchKVCache)
                     else BatchQuantizedKVCache([0] * len(rows), group_size=c.group_size, bits=c.bits))
            taken.state = (None if keys is None else each(lambda x: x[idx], keys),
                           None if values is None else each(lambda x: x[idx], values), offset[idx], left_padding[idx])
            taken.filter(mx.arange(len(rows)))  # drops the padding no kept row needs
        else:
            taken = ArraysCache(len(c.cache))
            taken.state = [None if a is None else a[idx] for a in c.state]
        out.append(taken)
    return out

"""Exact prompt-state snapshots for the prefix cache (GPU thread only).

The PrefixCacheStore actor owns the index (which prefix, how many bytes, when to evict); the
arrays live here, behind integer handles, and are created, restored and freed only on the GPU
executor's thread.

A snapshot of a batch-1 prompt cache at length S:
- attention layers (`KVCache`; `QuantizedKVCache` where the KV cache is quantized, its triples kept
  as they are, entry kind "qkv"): the keys and values *sliced* to S (`keys[..., :S, :]`), a view
  that shares the live buffer. MLX arrays are values: the live request appending to its cache
  writes into a fresh buffer when the old one is shared (copy on write), and a request restored
  from the snapshot grows past S by concatenation (copy on append), so neither ever sees the
  other's tokens (pinned by tests/test_prefix_cache.py);
- recurrent layers (`ArraysCache`: GatedDeltaNet conv and SSM state), which cannot be trimmed:
  a copy of the state at exactly S;
- optionally the MTP head's caches (one entry fewer: the head's entry at S-1 pairs h_{S-1}
  with prompt token S, which differs between requests) and h_{S-1}, the target's last hidden
  state, so a restored row re-reads that pair with its own next token.

Bytes are counted as what the snapshot keeps alive: the whole buffer behind each KV view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from mlx_relay.engine.models.kv_quant import Buffer, each, nbytes

__all__ = ["Snapshot", "SnapshotPool", "restore_caches", "restore_for", "snapshot_caches"]


@dataclass(frozen=True)
class Snapshot:
    length: int
    # per layer: ("kv", (keys, values)), ("qkv", (keys, values, group size, bits)) with MLX's quantized
    # triples, or ("arrays", [state...])
    target: list[tuple[str, Any]]
    head: list[tuple[str, Any]] | None = None  # MTP head caches with length - 1 entries
    head_hidden: mx.array | None = None  # [1, 1, H]: h_{length-1}
    nbytes: int = 0


def _kv_view(cache: KVCache | QuantizedKVCache, length: int) -> tuple[tuple[Buffer, Buffer], int]:
    if cache.keys is None or length == 0:
        raise ValueError("cannot snapshot an empty KV cache")
    if cache.offset < length:
        raise ValueError(f"KV cache holds {cache.offset} tokens, fewer than the snapshot's {length}")
    kept = nbytes(cache.keys) + nbytes(cache.values)
    return (_cut(cache.keys, length), _cut(cache.values, length)), kept


def _cut(buf: Buffer, length: int) -> Buffer:
    return each(lambda x: x[..., :length, :], buf)


def snapshot_caches(caches: list[Any], length: int) -> tuple[list[tuple[str, Any]], int]:
    """Per-layer snapshot entries of a batch-1 cache that holds exactly `length` tokens in its
    recurrent layers (and at least that many in its KV layers), and the bytes they keep alive."""
    out: list[tuple[str, Any]] = []
    nbytes = 0
    for c in caches:
        if isinstance(c, KVCache):
            kv, n = _kv_view(c, length)
            out.append(("kv", kv))
        elif isinstance(c, QuantizedKVCache):
            kv, n = _kv_view(c, length)
            out.append(("qkv", (*kv, c.group_size, c.bits)))
        elif isinstance(c, ArraysCache):
            state = [None if a is None else mx.array(a) for a in c.state]  # a copy, not the live array
            n = sum(a.nbytes for a in state if a is not None)
            out.append(("arrays", state))
        else:
            raise TypeError(f"cannot snapshot a {type(c).__name__}")
        nbytes += n
    return out, nbytes


def restore_caches(entries: list[tuple[str, Any]]) -> list[Any]:
    """Fresh batch-1 caches holding the snapshot's state (KV as views, grown by copy on append)."""
    caches: list[Any] = []
    for kind, value in entries:
        if kind == "kv":
            c = KVCache()
            c.state = value  # public setter: offset = keys.shape[2]
        elif kind == "qkv":
            keys, values, group_size, bits = value
            c = QuantizedKVCache(group_size=group_size, bits=bits)
            c.state = (keys, values)  # (its setter leaves the offset: set through the public meta state)
            c.meta_state = (str(keys[0].shape[2]), str(group_size), str(bits))
        else:
            c = ArraysCache(len(value))
            c.state = list(value)
        caches.append(c)
    return caches


def restore_for(snap: Snapshot, prompt_length: int) -> tuple[list[Any], int]:
    """Fresh batch-1 caches for a row of `prompt_length` tokens restored from `snap`, and how many
    tokens they hold: all of the snapshot's where a prompt token is left to run (its logits give the
    first token); for a snapshot as long as the prompt, its keys and values up to the last prompt
    token (views: that token runs again). A recurrent state cannot be cut so: `ValueError` (the
    prefix index never matches a snapshot as long as the prompt, `cache/prefix_index.py`)."""
    if snap.length < prompt_length:
        return restore_caches(snap.target), snap.length
    keep = prompt_length - 1
    if keep < 1 or any(kind not in ("kv", "qkv") for kind, _ in snap.target):
        raise ValueError(f"a snapshot of {snap.length} tokens cannot restore a prompt of {prompt_length}: "
                         "at least one prompt token must run, and a recurrent state cannot be cut")
    return restore_caches([(kind, (_cut(value[0], keep), _cut(value[1], keep), *value[2:]))
                           for kind, value in snap.target]), keep


class SnapshotPool:
    """Handle -> Snapshot. Handles are never reused within a pool."""

    def __init__(self) -> None:
        self._items: dict[int, Snapshot] = {}
        self._next = 1
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, snap: Snapshot) -> int:
        arrays: list[mx.array] = []
        for _, value in (*snap.target, *(snap.head or ())):
            arrays.extend(a for a in (value if isinstance(value, (list, tuple)) else [value]) if a is not None)
        if snap.head_hidden is not None:
            arrays.append(snap.head_hidden)
        mx.eval(arrays)
        handle = self._next
        self._next += 1
        self._items[handle] = snap
        self.bytes += snap.nbytes
        return handle

    def get(self, handle: int) -> Snapshot:
        snap = self._items.get(handle)
        if snap is None:
            raise KeyError(f"no snapshot {handle}")
        return snap

    def free(self, handles: list[int]) -> int:
        freed = 0
        for h in handles:
            snap = self._items.pop(h, None)
            if snap is not None:
                self.bytes -= snap.nbytes
                freed += 1
        return freed

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

"""Prefix-cache snapshots to and from safetensors bytes (GPU thread only): the device half of the
prefix cache's disk tier.

`encode` turns a held `Snapshot` into the bytes of one safetensors file (MLX's own
`mx.save_safetensors`, into memory: one host copy of the already evaluated arrays; the file is
written off this thread, `cache.snapshot_files.write_atomic`). `decode` loads a file already
checked off this thread (`cache.snapshot_files.verify`: size, checksum, identity; its pages then
in the page cache, so MLX's `mx.load` is one copy from memory) into a `Snapshot` whose tensors
are checked, name by name, against the live model's cache layout
(`probe_layout`: one token through fresh caches, at start) before any of them can reach a
request: a file that does not fit raises `SnapshotLayoutError` and is never restored.

Tensor names: `t.{layer}.k` / `t.{layer}.v` (attention keys and values, sliced to the snapshot's
length), `t.{layer}.{slot}` (a recurrent layer's state slots), the MTP head's caches as `h.{...}`
with one token fewer, and `hh` (the target's last hidden state, which the head pairs with the
next token). Bytes are counted as held (the arrays a restored snapshot keeps alive).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_vlm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from mlx_relay.cache.snapshot_files import SnapshotCorrupt, SnapshotLayoutError
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import fresh_caches
from mlx_relay.engine.models.prefill_options import PrefillOptions

__all__ = ["CacheLayout", "LayerLayout", "decode", "dtype_name", "encode", "kv_layout", "probe_layout"]


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class LayerLayout:
    """One cache layer: "kv" (shapes of keys and values with the sequence axis as -1), "qkv" (the
    same of each part of quantized keys and values: packed, scales, biases, then the values'; `quant`
    their group size and bits) or "arrays" (each state slot's exact shape, None for an empty slot);
    the dtype of each."""

    kind: Literal["kv", "qkv", "arrays"]
    shapes: tuple[tuple[int, ...] | None, ...]
    dtypes: tuple[str | None, ...]
    quant: tuple[int, int] | None = None


@dataclass(frozen=True)
class CacheLayout:
    target: tuple[LayerLayout, ...]
    head: tuple[LayerLayout, ...] | None  # None: this engine has no MTP head
    hidden: tuple[tuple[int, ...], str] | None  # the head's carried hidden state: shape, dtype

    @property
    def dtype(self) -> str:
        """The attention caches' dtype (the snapshot dtype the disk tier's identity names; quantized
        keys and values: `q` and their bits, after their scales' dtype)."""
        for layer in self.target:
            if layer.kind == "qkv" and layer.quant is not None:
                return f"{layer.dtypes[1]}-q{layer.quant[1]}"
        return next((layer.dtypes[0] for layer in self.target if layer.kind == "kv" and layer.dtypes[0]),
                    next((d for layer in self.target for d in layer.dtypes if d), "unknown"))


def kv_layout(k: mx.array, v: mx.array) -> LayerLayout:
    """An attention layer's layout from its keys and values (any length)."""
    return LayerLayout("kv", ((*k.shape[:2], -1, k.shape[3]), (*v.shape[:2], -1, v.shape[3])),
                       (dtype_name(k.dtype), dtype_name(v.dtype)))


def _seq(a: mx.array) -> tuple[int, ...]:
    return (*a.shape[:2], -1, a.shape[3])


def _layer_layout(cache: Any) -> LayerLayout:
    if isinstance(cache, KVCache):
        return kv_layout(*cache.state)
    if isinstance(cache, QuantizedKVCache):
        parts = [*cache.state[0], *cache.state[1]]
        return LayerLayout("qkv", tuple(_seq(a) for a in parts), tuple(dtype_name(a.dtype) for a in parts),
                           (cache.group_size, cache.bits))
    if isinstance(cache, ArraysCache):
        state = list(cache.state)
        return LayerLayout("arrays", tuple(None if a is None else tuple(a.shape) for a in state),
                           tuple(None if a is None else dtype_name(a.dtype) for a in state))
    raise TypeError(f"cannot lay out a {type(cache).__name__}")


def probe_layout(lm: Any, head: Any | None = None, quant: KVQuant | None = None) -> CacheLayout:
    """The cache layout of `lm` (and of the MTP `head`): one token through fresh caches (the family's
    own, quantized as `quant` says, through its prefill)."""
    family = family_of(lm)
    caches = fresh_caches(lm, family.make_caches(lm), quant)
    positions = mx.zeros((3, 1, 1), dtype=mx.int32)
    hidden = family.prefill_forward(lm, mx.array([[0]]), None, caches, positions, PrefillOptions())
    head_layout = None
    if head is not None:
        dcache = head.make_cache()
        head.forward(mx.array([[0]]), hidden, dcache, mx.array([[0]]))
        mx.eval([c.state for c in dcache])
        head_layout = tuple(_layer_layout(c) for c in dcache)
    mx.eval([c.state for c in caches], hidden)
    return CacheLayout(tuple(_layer_layout(c) for c in caches), head_layout,
                       ((1, 1, hidden.shape[-1]), dtype_name(hidden.dtype)))


def _put(arrays: dict[str, mx.array], prefix: str, entries: list[tuple[str, Any]]) -> None:
    for i, (kind, value) in enumerate(entries):
        if kind == "kv":
            arrays[f"{prefix}.{i}.k"], arrays[f"{prefix}.{i}.v"] = value
        elif kind == "qkv":
            for n, buf in zip("kv", value[:2], strict=True):
                for j, a in enumerate(buf):
                    arrays[f"{prefix}.{i}.{n}{j}"] = a
        else:
            for j, a in enumerate(value):
                if a is not None:
                    arrays[f"{prefix}.{i}.{j}"] = a


def encode(snap: Snapshot, metadata: dict[str, str]) -> memoryview:
    """The snapshot as the bytes of a safetensors file with `metadata` (one host copy)."""
    arrays: dict[str, mx.array] = {}
    _put(arrays, "t", snap.target)
    if snap.head is not None and snap.head_hidden is not None:
        _put(arrays, "h", snap.head)
        arrays["hh"] = snap.head_hidden
    buf = io.BytesIO()
    mx.save_safetensors(buf, arrays, metadata)
    return buf.getbuffer()


def _take(arrays: dict[str, mx.array], name: str, shape: tuple[int, ...], dtype: str | None) -> mx.array:
    a = arrays.pop(name, None)
    if a is None:
        raise SnapshotLayoutError(f"no tensor {name}")
    if tuple(a.shape) != shape or dtype_name(a.dtype) != dtype:
        raise SnapshotLayoutError(f"{name} is {tuple(a.shape)} {dtype_name(a.dtype)}, "
                                  f"the model's caches need {shape} {dtype}")
    return a


def _entries(arrays: dict[str, mx.array], prefix: str, layout: tuple[LayerLayout, ...],
             length: int) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for i, layer in enumerate(layout):
        if layer.kind == "kv":
            kv = tuple(_take(arrays, f"{prefix}.{i}.{n}", tuple(length if d == -1 else d for d in shape),
                             dtype)
                       for n, shape, dtype in zip("kv", layer.shapes, layer.dtypes, strict=True)
                       if shape is not None)
            out.append(("kv", kv))
        elif layer.kind == "qkv" and layer.quant is not None:
            names = [f"{n}{j}" for n in "kv" for j in range(3)]
            parts = [_take(arrays, f"{prefix}.{i}.{name}", tuple(length if d == -1 else d for d in shape), dtype)
                     for name, shape, dtype in zip(names, layer.shapes, layer.dtypes, strict=True)
                     if shape is not None]
            out.append(("qkv", (tuple(parts[:3]), tuple(parts[3:]), *layer.quant)))
        else:
            out.append(("arrays", [None if shape is None else _take(arrays, f"{prefix}.{i}.{j}", shape, dtype)
                                   for j, (shape, dtype) in enumerate(zip(layer.shapes, layer.dtypes,
                                                                          strict=True))]))
    return out


def decode(source: str | bytes, length: int, layout: CacheLayout) -> Snapshot:
    """A `Snapshot` of `length` tokens from a verified file (its path, or its bytes), every tensor
    checked against `layout` (the head's caches are kept only where this engine has the head)."""
    try:
        loaded = mx.load(io.BytesIO(source) if isinstance(source, bytes) else source, format="safetensors")
    except Exception as exc:  # MLX's parser: a file that passed the checksum but is no safetensors
        raise SnapshotCorrupt(f"MLX could not read it: {exc}") from None
    assert isinstance(loaded, dict)
    arrays: dict[str, mx.array] = dict(loaded)
    target = _entries(arrays, "t", layout.target, length)
    head = hidden = None
    has_head = any(name.startswith("h.") for name in arrays) or "hh" in arrays
    if has_head and layout.head is not None and layout.hidden is not None and length > 1:
        head = _entries(arrays, "h", layout.head, length - 1)
        hidden = _take(arrays, "hh", *layout.hidden)
    elif has_head:  # this engine has no MTP head (or the head is laid out otherwise): not needed
        for name in [n for n in arrays if n.startswith("h.") or n == "hh"]:
            del arrays[name]
    if arrays:
        raise SnapshotLayoutError(f"tensors the model's caches do not have: {sorted(arrays)[:4]}")
    nbytes = sum(a.nbytes for _, value in (*target, *(head or ())) for _, a in tree_flatten(value)
                 if isinstance(a, mx.array))
    nbytes += hidden.nbytes if hidden is not None else 0
    return Snapshot(length=length, target=target, head=head, head_hidden=hidden, nbytes=nbytes)

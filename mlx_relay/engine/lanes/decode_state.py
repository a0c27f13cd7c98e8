"""The decode batch's device state in a layout a compiled step can take (GPU thread only).

mlx-vlm's batch caches keep their write position in Python (`BatchKVCache._idx`, offsets
advanced in place), so a traced step would keep writing the same slot. Here every piece of
state is an array the step takes and returns:
- per attention layer: keys and values `[B, H, cap, D]`, written at column `idx` (one column
  for the whole batch; row i's keys live in `[left_padding[i], idx)`, the columns before are
  padding and masked); where the KV cache is quantized, each MLX's quantized triple
  (`models.kv_quant`: every operation here acts on its parts alike);
- per GatedDeltaNet layer: the conv window `[B, K-1, C]` and the recurrent state `[B, Hv, Dv, Dk]`;
- per row: its M-RoPE delta (decode position = tokens in its cache + delta).
`cap` grows in steps of `GROW` columns and the batch is padded with idle rows to a few sizes
(`batch_bucket`: 1, 2, 4, 8, then multiples of 8), so a compiled step sees few distinct shapes
and each can be traced before traffic.

Rows arrive from a prefill chunk as mlx-vlm batch caches (`from_batch_caches`), join with
`extend` (right edges aligned: the shorter side is left-padded), leave with `filter`, and a
row's state goes back to batch-1 library caches for its turn snapshot (`row_caches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache, BatchKVCache, BatchQuantizedKVCache, KVCache, QuantizedKVCache

from mlx_relay.engine.models.kv_quant import Buffer, each, first, is_quantized

GROW = 256  # columns added when the KV buffers are full (attention reads every column: keep few spare)


def batch_bucket(rows: int) -> int:
    """The batch size a decode step runs at for `rows` rows (the rest are idle rows)."""
    if rows <= 8:
        return 1 << max(0, rows - 1).bit_length()
    return -(-rows // 8) * 8


def _cap_for(columns: int) -> int:
    return max(GROW, -(-columns // GROW) * GROW)


def _shift(buf: Buffer, by: int, cap: int) -> Buffer:
    """`buf`'s columns moved right by `by` (zeros before), as a buffer of `cap` columns."""
    return each(lambda x: _shift_array(x, by, cap), buf)


def _shift_array(buf: mx.array, by: int, cap: int) -> mx.array:
    B, H, n, D = buf.shape
    parts = [mx.zeros((B, H, by, D), buf.dtype)] if by > 0 else []
    parts.append(buf[:, :, :max(0, min(n, cap - by)), :])
    out = mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
    if out.shape[2] < cap:
        out = mx.concatenate([out, mx.zeros((B, H, cap - out.shape[2], D), buf.dtype)], axis=2)
    return out


@dataclass
class DecodeState:
    kv: list[tuple[Buffer, Buffer]]  # per attention layer, in layer order
    conv: list[mx.array]  # per GatedDeltaNet layer, in layer order
    ssm: list[mx.array]
    idx: int  # the next column written
    left_padding: mx.array  # [B] int32
    deltas: mx.array  # [B] int32
    layout: tuple[bool, ...]  # per layer: True for a GatedDeltaNet layer
    quant: tuple[int, int] | None = None  # the keys' and values' (group size, bits) where quantized

    @property
    def cap(self) -> int:
        return first(self.kv[0][0]).shape[2] if self.kv else 0

    @property
    def batch_size(self) -> int:
        return int(self.left_padding.shape[0])

    def arrays(self) -> list[Any]:
        return [self.kv, self.conv, self.ssm, self.left_padding, self.deltas]

    @classmethod
    def from_batch_caches(cls, caches: list[Any], rope_deltas: list[int]) -> DecodeState:
        """The state of prefilled rows handed over in mlx-vlm batch caches (one copy)."""
        kv, conv, ssm, layout = [], [], [], []
        idx, left_padding, quant = 0, None, None
        for c in caches:
            if isinstance(c, (BatchKVCache, BatchQuantizedKVCache)):
                keys, values, _offset, lp = c.state
                idx, left_padding = first(keys).shape[2], lp
                if isinstance(c, BatchQuantizedKVCache):
                    quant = (c.group_size, c.bits)
                cap = _cap_for(idx + 1)
                kv.append((_shift(keys, 0, cap), _shift(values, 0, cap)))
                layout.append(False)
            elif isinstance(c, ArraysCache):
                conv_state, ssm_state = c.state
                conv.append(conv_state)
                ssm.append(ssm_state)
                layout.append(True)
            else:
                raise TypeError(f"cannot decode from a {type(c).__name__}")
        if left_padding is None:
            raise ValueError("a decode batch needs at least one attention layer")
        return cls(kv, conv, ssm, idx, left_padding.astype(mx.int32),
                   mx.array(rope_deltas, dtype=mx.int32), tuple(layout), quant)

    @classmethod
    def from_row_caches(cls, caches: list[Any], layout: tuple[bool, ...]) -> DecodeState:
        """One row's state from its batch-1 library caches (either library's; `library_caches`' inverse):
        keys and values to their offset, the recurrent layers' conv window and state as they are."""
        kv, conv, ssm = [], [], []
        idx, quant = 0, None
        for linear, c in zip(layout, caches, strict=True):
            if linear:
                conv_state, ssm_state = c.state
                conv.append(conv_state)
                ssm.append(ssm_state)
            else:
                idx = int(c.offset)
                if isinstance(c, QuantizedKVCache):
                    quant = (c.group_size, c.bits)
                upto = lambda x, end=idx: x[:, :, :end, :]  # noqa: E731
                keys, values = each(upto, c.state[0]), each(upto, c.state[1])
                cap = _cap_for(idx + 1)
                kv.append((_shift(keys, 0, cap), _shift(values, 0, cap)))
        if not kv:
            raise ValueError("a decode state needs at least one attention layer")
        return cls(kv, conv, ssm, idx, mx.zeros((1,), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32), layout,
                   quant)

    def pad_to(self, rows: int) -> None:
        """Append idle rows (zero state, attending only to their own columns) up to `rows`."""
        k = rows - self.batch_size
        if k <= 0:
            return
        def grown(x: mx.array) -> mx.array:
            return mx.concatenate([x, mx.zeros((k, *x.shape[1:]), x.dtype)])

        self.kv = [(each(grown, keys), each(grown, values)) for keys, values in self.kv]
        self.conv = [grown(x) for x in self.conv]
        self.ssm = [grown(x) for x in self.ssm]
        self.left_padding = mx.concatenate([self.left_padding, mx.full((k,), self.idx, dtype=mx.int32)])
        self.deltas = mx.concatenate([self.deltas, mx.zeros((k,), dtype=mx.int32)])

    def ensure_room(self, columns: int = 1) -> None:
        """Grow the KV buffers when the next `columns` columns would not fit."""
        if self.idx + columns <= self.cap:
            return
        cap = _cap_for(self.idx + columns)
        self.kv = [(_shift(k, 0, cap), _shift(v, 0, cap)) for k, v in self.kv]

    def extend(self, other: DecodeState) -> None:
        """Append `other`'s rows, right edges aligned (in place)."""
        idx = max(self.idx, other.idx)
        cap = _cap_for(max(self.cap, other.cap, idx + 1))
        a, b = idx - self.idx, idx - other.idx
        def joined(x: Buffer, y: Buffer) -> Buffer:
            return each(lambda p, q: mx.concatenate([p, q]), _shift(x, a, cap), _shift(y, b, cap))

        self.kv = [(joined(k1, k2), joined(v1, v2)) for (k1, v1), (k2, v2) in zip(self.kv, other.kv, strict=True)]
        self.conv = [mx.concatenate([x, y]) for x, y in zip(self.conv, other.conv, strict=True)]
        self.ssm = [mx.concatenate([x, y]) for x, y in zip(self.ssm, other.ssm, strict=True)]
        self.left_padding = mx.concatenate([self.left_padding + a, other.left_padding + b])
        self.deltas = mx.concatenate([self.deltas, other.deltas])
        self.idx = idx

    def filter(self, keep: list[int]) -> None:
        """Keep only rows `keep` (in place), dropping the padding no kept row needs."""
        rows = mx.array(keep, dtype=mx.int32)
        left_padding = self.left_padding[rows]
        trim = min(int(left_padding.min().item()), self.idx)
        cap = self.cap
        def kept(x: mx.array) -> mx.array:
            return x[rows][:, :, trim:, :]

        self.kv = [(_shift(each(kept, k), 0, cap), _shift(each(kept, v), 0, cap)) for k, v in self.kv]
        self.conv = [x[rows] for x in self.conv]
        self.ssm = [x[rows] for x in self.ssm]
        self.left_padding = left_padding - trim
        self.deltas = self.deltas[rows]
        self.idx -= trim

    def row_caches(self, i: int) -> list[Any]:
        """Row `i`'s state as batch-1 library caches (copies), in layer order."""
        return library_caches(self.layout, self.kv, self.conv, self.ssm, i, int(self.left_padding[i].item()), self.idx,
                              self.quant)


def library_caches(layout: tuple[bool, ...], kv: list[tuple[Buffer, Buffer]], conv: list[mx.array],
                   ssm: list[mx.array], i: int, start: int, end: int,
                   quant: tuple[int, int] | None = None) -> list[Any]:
    """Row `i` of explicit decode state as batch-1 library caches (copies), in layer order: the
    recurrent layers' conv window and state, the attention layers' keys and values in columns
    [start, end) (quantized ones, of `quant`'s (group size, bits), as the library's `QuantizedKVCache`)."""
    kv_in, gdn = iter(kv), iter(zip(conv, ssm, strict=True))
    out: list[Any] = []
    for linear in layout:
        if linear:
            conv_state, ssm_state = next(gdn)
            c = ArraysCache(2)
            c.state = [mx.array(conv_state[i:i + 1]), mx.array(ssm_state[i:i + 1])]
        else:
            keys, values = next(kv_in)
            def row(x: mx.array) -> mx.array:
                return mx.contiguous(x[i:i + 1, :, start:end, :])

            if is_quantized(keys):
                assert quant is not None, "quantized keys without their group size and bits"
                c = QuantizedKVCache(group_size=quant[0], bits=quant[1])
                c.state = (each(row, keys), each(row, values))
                c.meta_state = (str(end - start), str(quant[0]), str(quant[1]))
            else:
                c = KVCache()
                c.state = (row(keys), row(values))
        out.append(c)
    return out

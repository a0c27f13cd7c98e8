"""The MTP lane's cohort state in a layout a compiled round can take (GPU thread only; used by
`mtp_lane.MTPLane` when its rounds are compiled, `mtp_step.MTPStep`).

Like `decode_state.DecodeState`, every piece of state is an array the round takes and returns,
but rows are *left-aligned* and each has its own write index, because a round commits a
different number of tokens per row:
- per target attention layer: keys and values `[B, H, cap, D]`; row i's keys are columns
  `[0, lengths[i])`; a round writes its k positions at `lengths[i] .. lengths[i] + k - 1`
  (`mx.put_along_axis`) and commits the first `m[i] + 1` of them by advancing `lengths[i]`:
  the rejected columns are beyond the row's length, masked, and overwritten next round;
- per GatedDeltaNet layer: the conv window `[B, K-1, C]` and the recurrent state
  `[B, Hv, Dv, Dk]` after the row's last committed token (the round selects them among its k
  positions);
- per head layer: keys and values `[B, H, hcap, D]` of the MTP head, columns
  `[0, head_lengths[i])`, written the same way (none for a checkpoint without a head);
- per row: `bonus` (the last emitted token, not yet in the target cache), `draft` (the head's
  proposal after it), `seed` (the head output that proposed it, `[B, 1, H]`), and on the host the
  row's `lengths`, `head_lengths` and head position `dpos`, which the host knows exactly from the
  counts each round reads back (no extra synchronisation).
The batch is padded with idle rows to `decode_state.batch_bucket` sizes and the buffers grow in
steps of `decode_state.GROW` columns, so a compiled round sees few shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache, KVCache, QuantizedKVCache

from mlx_relay.engine.lanes.decode_state import GROW, batch_bucket, library_caches
from mlx_relay.engine.models.kv_quant import Buffer, each, first


def _cap_for(columns: int) -> int:
    return max(GROW, -(-columns // GROW) * GROW)


def _to_cap(buf: Buffer, cap: int) -> Buffer:
    """`buf` [B, H, n, D] cut or zero-padded on the right to `cap` columns (a quantized one, each part)."""
    return each(lambda x: _array_to_cap(x, cap), buf)


def _array_to_cap(buf: mx.array, cap: int) -> mx.array:
    B, H, n, D = buf.shape
    if n >= cap:
        return buf[:, :, :cap, :]
    return mx.concatenate([buf, mx.zeros((B, H, cap - n, D), buf.dtype)], axis=2)


def _pad_rows(x: mx.array, rows: int) -> mx.array:
    k = rows - x.shape[0]
    return mx.concatenate([x, mx.zeros((k, *x.shape[1:]), x.dtype)]) if k > 0 else x


@dataclass
class MTPState:
    kv: list[tuple[mx.array, mx.array]]  # target attention layers, in layer order
    conv: list[mx.array]  # target GatedDeltaNet layers, in layer order
    ssm: list[mx.array]
    head_kv: list[tuple[mx.array, mx.array]]  # MTP head layers
    bonus: mx.array  # [B] int32
    draft: mx.array  # [B] int32
    seed: mx.array  # [B, 1, H]
    lengths: list[int]  # per real row: target tokens cached (its next write column)
    head_lengths: list[int]  # per real row: head pairs cached
    dpos: list[int]  # per real row: the head position of its next pair
    layout: tuple[bool, ...]  # per target layer: True for a GatedDeltaNet layer
    quant: tuple[int, int] | None = None  # the target's keys and values' (group size, bits) where quantized

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def batch_size(self) -> int:
        return int(self.bonus.shape[0])

    @property
    def cap(self) -> int:
        return first(self.kv[0][0]).shape[2]

    @property
    def head_cap(self) -> int:
        return self.head_kv[0][0].shape[2] if self.head_kv else 0

    def arrays(self) -> list[Any]:
        return [self.kv, self.conv, self.ssm, self.head_kv, self.bonus, self.draft, self.seed]

    def index_arrays(self) -> tuple[mx.array, mx.array, mx.array]:
        """(lengths, head_lengths, dpos) as [B] int32 arrays (idle rows: 0)."""
        return self._padded(self.lengths), self._padded(self.head_lengths), self._padded(self.dpos)

    def lengths_array(self) -> mx.array:
        """The rows' lengths alone (a round without the head reads no more)."""
        return self._padded(self.lengths)

    def _padded(self, values: list[int]) -> mx.array:
        return mx.array(values + [0] * (self.batch_size - self.rows), dtype=mx.int32)

    @classmethod
    def from_row(cls, caches: list[Any], head_caches: list[Any], layout: tuple[bool, ...], bonus: mx.array,
                 draft: mx.array, seed: mx.array, dpos: int) -> MTPState:
        """One prefilled row from its batch-1 library caches (target in layer order, head)."""
        kv, conv, ssm, length, quant = [], [], [], 0, None
        for c in caches:
            if isinstance(c, (KVCache, QuantizedKVCache)):
                keys, values = c.state
                length = first(keys).shape[2]
                cap = _cap_for(length + 1)
                kv.append((_to_cap(keys, cap), _to_cap(values, cap)))
                if isinstance(c, QuantizedKVCache):
                    quant = (c.group_size, c.bits)
            elif isinstance(c, ArraysCache):
                conv_state, ssm_state = c.state
                conv.append(conv_state)
                ssm.append(ssm_state)
            else:
                raise TypeError(f"the compiled MTP round cannot run from a {type(c).__name__}")
        head_kv, head_length = [], 0
        for c in head_caches:
            if not isinstance(c, KVCache) or c.keys is None:
                raise TypeError("the compiled MTP round needs the head's KV caches")
            keys, values = c.state
            head_length = keys.shape[2]
            cap = _cap_for(head_length + 1)
            head_kv.append((_to_cap(keys, cap), _to_cap(values, cap)))
        return cls(kv, conv, ssm, head_kv, bonus.reshape(1).astype(mx.int32), draft.reshape(1).astype(mx.int32),
                   seed, [length], [head_length], [dpos], layout, quant)

    @classmethod
    def prefilled(cls, lm: Any, head: Any, prompt: list[int]) -> tuple[MTPState, mx.array]:
        """One row prefilled from scratch by the library's forward (the target, then the head over
        the prompt's pairs), padded to its bucket, and its first token: a row as the lane hands it
        over, for the tests and the benchmarks that drive `MTPStep` alone."""
        cache = lm.make_cache()
        out = lm(mx.array([prompt]), cache=cache, return_hidden=True)
        first = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
        head_cache = head.make_cache()
        pairs = mx.concatenate([mx.array([prompt[1:]], dtype=mx.int32), first[None]], axis=1)
        seed = head.forward(pairs, out.hidden_states[-1], head_cache, mx.arange(len(prompt))[None])[:, -1:, :]
        layout = tuple(bool(layer.is_linear) for layer in lm.model.layers)
        state = cls.from_row(cache, head_cache, layout, first, head.argmax(seed).reshape(1), seed, len(prompt))
        state.pad_to_bucket()
        return state, first

    def _map_rows(self, fn: Any) -> None:
        """Apply `fn` to every per-row array (batch axis first)."""
        self.kv = [(each(fn, k), each(fn, v)) for k, v in self.kv]
        self.conv = [fn(x) for x in self.conv]
        self.ssm = [fn(x) for x in self.ssm]
        self.head_kv = [(fn(k), fn(v)) for k, v in self.head_kv]
        self.bonus, self.draft, self.seed = fn(self.bonus), fn(self.draft), fn(self.seed)

    def pad_to_bucket(self) -> None:
        """Idle rows (zero state, length 0) up to the batch's bucket size."""
        size = batch_bucket(self.rows)
        if size > self.batch_size:
            self._map_rows(lambda x: _pad_rows(x, size))

    def ensure_room(self, k: int) -> None:
        """Grow the buffers so that every row can write `k` more columns."""
        need = max(self.lengths) + k
        if need > self.cap:
            cap = _cap_for(need)
            self.kv = [(_to_cap(a, cap), _to_cap(b, cap)) for a, b in self.kv]
        need = max(self.head_lengths) + k
        if self.head_kv and need > self.head_cap:
            cap = _cap_for(need)
            self.head_kv = [(_to_cap(a, cap), _to_cap(b, cap)) for a, b in self.head_kv]

    def extend(self, other: MTPState) -> None:
        """Append `other`'s real rows (in place; idle rows dropped, then re-padded)."""
        n, m = self.rows, other.rows
        cap, head_cap = max(self.cap, other.cap), max(self.head_cap, other.head_cap)

        def join(a: Buffer, b: Buffer, width: int | None = None) -> Buffer:
            a, b = each(lambda x: x[:n], a), each(lambda x: x[:m], b)
            if width is not None:
                a, b = _to_cap(a, width), _to_cap(b, width)
            return each(lambda x, y: mx.concatenate([x, y]), a, b)

        self.kv = [(join(k1, k2, cap), join(v1, v2, cap)) for (k1, v1), (k2, v2) in zip(self.kv, other.kv, strict=True)]
        self.head_kv = [(join(k1, k2, head_cap), join(v1, v2, head_cap))
                        for (k1, v1), (k2, v2) in zip(self.head_kv, other.head_kv, strict=True)]
        self.conv = [join(x, y) for x, y in zip(self.conv, other.conv, strict=True)]
        self.ssm = [join(x, y) for x, y in zip(self.ssm, other.ssm, strict=True)]
        self.bonus, self.draft = join(self.bonus, other.bonus), join(self.draft, other.draft)
        self.seed = join(self.seed, other.seed)
        self.lengths += other.lengths
        self.head_lengths += other.head_lengths
        self.dpos += other.dpos
        self.pad_to_bucket()

    def filter(self, keep: list[int]) -> None:
        """Keep only real rows `keep` (in place), re-padded to their bucket."""
        rows = mx.array(keep, dtype=mx.int32)
        self._map_rows(lambda x: x[rows])
        self.lengths = [self.lengths[i] for i in keep]
        self.head_lengths = [self.head_lengths[i] for i in keep]
        self.dpos = [self.dpos[i] for i in keep]
        self.pad_to_bucket()

    def row_caches(self, i: int, length: int | None = None, conv: list[mx.array] | None = None,
                   ssm: list[mx.array] | None = None) -> list[Any]:
        """Row `i`'s target state as batch-1 library caches (copies), in layer order: its keys up to
        `length` (default: all it has) and the GatedDeltaNet states `conv`, `ssm` (default: its own)."""
        return library_caches(self.layout, self.kv, self.conv if conv is None else conv,
                              self.ssm if ssm is None else ssm, i, 0, self.lengths[i] if length is None else length,
                              self.quant)

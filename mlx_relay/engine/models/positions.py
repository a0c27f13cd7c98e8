"""Where a forward's T positions sit in explicit caches (GPU thread only): the rotary positions,
the attention mask over the key/value buffers' columns, and where each position's keys and values
are written. One value for every family's `forward_block` and MTP head (`models.ModelFamily`).

Two ways to write: the decode step writes every row's one position at the same column
(`Positions.column`: `mx.slice_update`, the rows' left padding keeps them aligned); the MTP
verify and head write each row's T positions at its own columns (`Positions.per_row`:
`mx.put_along_axis`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_relay.engine.models.kv_quant import Buffer, is_quantized, layout, quantize


def text_positions(start: int, end: int) -> mx.array:
    """The M-RoPE positions [3, 1, end - start] of one row's text tokens start..end-1 (every
    section the token's index), as the families' `prefill_forward` takes them."""
    return mx.broadcast_to(mx.arange(start, end, dtype=mx.int32)[None, None], (3, 1, end - start))


@dataclass(frozen=True)
class Positions:
    rotary: mx.array  # the positions the attention's rotary embedding takes
    mask: mx.array  # the attention mask over the buffers' columns
    column: mx.array | None  # a scalar: every row writes its one position there
    where: mx.array | None  # [B, 1, T, 1]: row i's position t is written at column where[i, 0, t, 0]
    # [B]: where the T positions are text positions (one value for every M-RoPE section, row i's
    # at offsets[i] + t), as in the decode step and the MTP verify: the attention may rotate with
    # MLX's fused rope (`mx.fast.rope` with a per-row offset) instead of the library's M-RoPE ops
    offsets: mx.array | None = None

    @staticmethod
    def at_column(column: mx.array, rotary: mx.array, mask: mx.array, offsets: mx.array | None = None) -> Positions:
        return Positions(rotary, mask, column, None, offsets)

    @staticmethod
    def per_row(columns: mx.array, rotary: mx.array, mask: mx.array, offsets: mx.array | None = None) -> Positions:
        """`columns` [B, T]."""
        return Positions(rotary, mask, None, columns[:, None, :, None], offsets)

    def write(self, buf: Buffer, new: mx.array) -> Buffer:
        """`buf` [B, heads, cap, D] with `new` [B, heads, T, D] written at these positions (a quantized
        buffer: `new` quantized as it is, each part written alike; `kv_quant`)."""
        if is_quantized(buf):
            group_size, bits = layout(buf, new.shape[-1])  # type: ignore[arg-type]
            return tuple(self._write(b, n) for b, n in zip(buf, quantize(new, group_size, bits), strict=True))
        return self._write(buf, new)  # type: ignore[arg-type]

    def _write(self, buf: mx.array, new: mx.array) -> mx.array:
        new = new.astype(buf.dtype)
        if self.where is None:
            return mx.slice_update(buf, new, self.column, axes=(2,))
        return mx.put_along_axis(buf, mx.broadcast_to(self.where, new.shape), new, axis=2)

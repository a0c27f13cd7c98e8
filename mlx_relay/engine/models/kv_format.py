"""How quantized attention keys and values are laid out (issue 47.2; pure, no MLX): their bits, their
group along a head, and what a value costs in memory. `kv_quant.py` keeps them on the device; the
model pool's reservation (`footprint.with_kv_bits`) and the engine's memory budget count them from this.
"""

from __future__ import annotations

import msgspec

BITS = (4, 8)


class KVQuant(msgspec.Struct, frozen=True):
    """How attention keys and values are kept: `bits` per value (8 or 4) in groups along the head
    dimension (`group_for`), each group with a scale and a bias of the model's 16-bit dtype."""

    bits: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"KV bits must be one of {BITS}, not {self.bits}")

    @staticmethod
    def group_for(head_dim: int) -> int:
        """The quantization group along a head of `head_dim` values: 64, or 32 for heads that 64
        does not divide (MLX's quantization takes 32, 64 or 128)."""
        if head_dim % 64 == 0:
            return 64
        if head_dim % 32 == 0:
            return 32
        raise ValueError(f"a head of {head_dim} values cannot be quantized in groups of 32 or 64")

    def bytes_per_value(self, head_dim: int, width: int) -> float:
        """What one key or value element costs: its bits, and its group's scale and bias of `width` bytes."""
        return self.bits / 8 + 2 * width / self.group_for(head_dim)

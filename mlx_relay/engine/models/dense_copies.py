"""16-bit copies of a model's dense 8-bit projections, kept beside them (GPU thread only; at load,
`loader.add_dense_copies`, with `EngineConfig.dense_16bit` / `--dense-16bit`).

    added_bytes = add_dense_copies(layers)    # each 8-bit nn.QuantizedLinear of `layers` -> DenseCopy

MLX's quantized matmul over more than a few rows is far from what the device can do: on an H200, a
step's dense projections of the 35B-A3B shape take 8.9 / 15.7 / 23.8 / 57.1 ms at 8 / 64 / 264 /
2,048 rows through it, and 1.9 / 2.5 / 4.2 / 12.9 ms as a 16-bit matmul over weights already
dequantized (`benchmarks/results/gpu-h200-2026-11-29b/`, `dense_rows.txt`: the decode step of 8 to
64 rows, a slice beside them, a prefill chunk). A `DenseCopy` keeps the projection's 8-bit weights
for fewer than `FEW_ROWS` rows (MLX's matrix-vector kernel reads half the bytes: the one-row decode
step) and a 16-bit copy for more, at the price of that copy's memory (2.9 GB on the 35B-A3B shape,
counted in the rows' budget: the copies are made before it is planned). The experts (mlx-vlm's
`QuantizedSwitchLinear`), the embeddings and the head are not copied.

The copy is what the library's own dequantization gives (`mx.dequantize`, in the scales' dtype);
`tests/test_dense_copies.py` pins a copied model's tokens and logits to the 8-bit model's (float32).
Nothing of the library is patched: the layers' modules are swapped through `Module.update_modules`,
as `mlx.nn.quantize` swaps them the other way.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_relay.engine.models.merged_projections import ProjectionPart

FEW_ROWS = 8  # rows of x from which a copy's 16-bit weights run (below: the 8-bit call)


class DenseCopy(nn.Module):
    """A dense 8-bit projection and its 16-bit copy: `quantized(x)` below `FEW_ROWS` rows, else
    `x @ weight16.T` (plus the bias)."""

    def __init__(self, quantized: nn.QuantizedLinear) -> None:
        super().__init__()
        self.quantized = quantized
        self.weight16 = mx.dequantize(quantized.weight, quantized.scales, quantized.biases,
                                      group_size=quantized.group_size, bits=quantized.bits,
                                      mode=quantized.mode).astype(quantized.scales.dtype)

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] < FEW_ROWS:
            out: mx.array = self.quantized(x)
            return out
        w = self.weight16 if self.weight16.dtype == x.dtype else self.weight16.astype(x.dtype)
        y = x @ w.T
        return y + self.quantized.bias if "bias" in self.quantized else y


def copies_of(layer: nn.Module) -> dict[str, Any]:
    """The swaps for one decoder layer: each affine `nn.QuantizedLinear` in it (not the experts'
    switch, a class of its own; a merged projection's part too, which then runs alone) as a
    `DenseCopy`, by its path in the layer."""
    return {name: DenseCopy(m) for name, m in layer.named_modules()
            if type(m) in (nn.QuantizedLinear, ProjectionPart) and m.mode == "affine"}


def add_dense_copies(layers: list[Any]) -> int:
    """Swap every dense 8-bit projection of `layers` for a `DenseCopy` (evaluated here); the bytes added."""
    added = 0
    for layer in layers:
        swaps = copies_of(layer)
        if not swaps:
            continue
        layer.update_modules(tree_unflatten(list(swaps.items())))
        copies = [copy.weight16 for copy in swaps.values()]
        mx.eval(copies)
        added += sum(w.nbytes for w in copies)
    return added

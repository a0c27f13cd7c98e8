"""Projections of one input merged into one weight (GPU thread only; at load: `loader.load_model`,
or `loader.add_copies` for a pipeline stage's lazily loaded layers, calls `merge_projections` with
the family's `ModelFamily.merged_groups`).

    merged = merge_projections(layers, groups)   # e.g. a GatedDeltaNet's four input projections
    parts = merged_parts(modules)                # the one `nn.QuantizedLinear` they are rows of, or None

A decode step on a GPU is bound by the host's ~10 us a kernel launch (the 35B-A3B shape's one-row
step: 1,002 launches, the GPU busy 5.6 of 17.0 ms under the profiler,
`benchmarks/results/gpu-h200-2026-11-29d/`), and 391 of those launches are MLX's matrix-vector
products of the dense projections, several a layer over the same input: a GatedDeltaNet's
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, an attention layer's `q_proj`, `k_proj`,
`v_proj`, a gated MLP's `gate_proj` and `up_proj`, a mixture of experts' router and its shared
expert's gate. Where those are 8-bit (or 4-bit) affine `nn.QuantizedLinear`s of one layout, their
weights, scales and biases are concatenated once into one `nn.QuantizedLinear` (kept outside the
module tree; its output padded with zero rows to whole `PAD_COLUMNS`), and each projection becomes
a `ProjectionPart`: an `nn.QuantizedLinear` whose arrays are its rows of the merged ones (views of
the same memory: the model's bytes do not change but for the padding, at most 15 rows a group),
whose own call is the library's as before. The family's layer loop asks `merged_parts` and runs the
merged product once, then splits it (on a CUDA GPU over more than one row only where the parts are
read in place, not attention's q/k/v: `qwen3_5/kernels/dense.dense_many` says why): the same
numbers, since each output column is its own dot product
(`tests/test_merged_projections.py` pins the logits and the decode step's tokens of a merged 8-bit
model to the unmerged one's).

Nothing of the library is patched: the layers' modules are swapped through `Module.update_modules`,
as `mlx.nn.quantize` swaps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

QL = TypeVar("QL", bound=nn.QuantizedLinear)

#: the merged output columns are padded (zero rows, never read) to a multiple of this: our narrow
#: CUDA kernel tiles 16 columns (`qwen3_5/kernels/dense.fits`), so a router's 256 columns and its
#: shared expert's gate's 1 run as 272 where 257 would leave it for MLX's wider tile
PAD_COLUMNS = 16


class MergedWeights:
    """The merged projection and each part's output columns (a plain holder: outside the module
    tree, so the model's parameters count each weight once, as the parts' views; the padding rows,
    if any, are the merged weight's alone)."""

    def __init__(self, linear: nn.QuantizedLinear, sizes: tuple[int, ...]) -> None:
        self.linear = linear
        self.sizes = sizes

    def split(self, y: mx.array) -> tuple[mx.array, ...]:
        """The parts' outputs of the merged product `y` (the padding's left out)."""
        cuts, at = [], 0
        for size in self.sizes:
            at += size
            cuts.append(at)
        return tuple(mx.split(y, cuts, axis=-1))[:len(self.sizes)]


def _holding(cls: type[QL], arrays: dict[str, mx.array], like: nn.QuantizedLinear) -> QL:
    """A `cls` (an `nn.QuantizedLinear`) of `like`'s layout holding `arrays` (weight, scales and, if
    any, biases; its own initial weights are lazy and never evaluated)."""
    q = cls(like.scales.shape[-1] * like.group_size, arrays["weight"].shape[0], bias=False,
            group_size=like.group_size, bits=like.bits, mode=like.mode)
    q.update(arrays)
    return q


class ProjectionPart(nn.QuantizedLinear):
    """One projection's rows of a merged weight: an `nn.QuantizedLinear` over views of the merged
    arrays, `merged` and `index` saying whose part it is."""

    merged: MergedWeights
    index: int

    @staticmethod
    def of(merged: MergedWeights, index: int, start: int) -> ProjectionPart:
        whole = merged.linear
        stop = start + merged.sizes[index]
        part = _holding(ProjectionPart, {name: getattr(whole, name)[start:stop]
                                         for name in ("weight", "scales", "biases") if name in whole}, whole)
        part.merged, part.index = merged, index
        part.freeze()
        return part


def mergeable(modules: Sequence[Any]) -> bool:
    """Whether these projections can be one: plain affine `nn.QuantizedLinear`s without a bias, of one
    input size, group size, bits and dtype."""
    if len(modules) < 2 or not all(type(m) is nn.QuantizedLinear for m in modules):
        return False
    first = modules[0]
    return all("bias" not in m and m.mode == "affine" and m.group_size == first.group_size
               and m.bits == first.bits and m.weight.shape[1] == first.weight.shape[1]
               and m.scales.dtype == first.scales.dtype and ("biases" in m) == ("biases" in first)
               for m in modules)


def merge(modules: Sequence[nn.QuantizedLinear]) -> list[ProjectionPart]:
    """The parts that replace `modules` (`mergeable` ones), the merged arrays evaluated here."""
    first = modules[0]
    rows = sum(m.weight.shape[0] for m in modules)
    pad = -rows % PAD_COLUMNS
    arrays = {name: mx.concatenate([getattr(m, name) for m in modules]
                                   + ([mx.zeros((pad, getattr(first, name).shape[1]), getattr(first, name).dtype)]
                                      if pad else []))
              for name in ("weight", "scales", "biases") if name in first}
    mx.eval(arrays)
    merged = MergedWeights(_holding(nn.QuantizedLinear, arrays, first), tuple(m.weight.shape[0] for m in modules))
    parts, start = [], 0
    for i, m in enumerate(modules):
        parts.append(ProjectionPart.of(merged, i, start))
        start += m.weight.shape[0]
    mx.eval([p.parameters() for p in parts])
    return parts


def merged_parts(modules: Sequence[Any]) -> MergedWeights | None:
    """The merged weights `modules` are, in order, the whole of; None if they are not."""
    first = modules[0]
    if not isinstance(first, ProjectionPart) or len(modules) != len(first.merged.sizes):
        return None
    ok = all(isinstance(m, ProjectionPart) and m.merged is first.merged and m.index == i for i, m in enumerate(modules))
    return first.merged if ok else None


def merge_projections(layers: Sequence[Any], groups: Sequence[tuple[str, ...]]) -> int:
    """In each of `layers`, each group of projections (paths in the layer, e.g. `("self_attn.q_proj",
    "self_attn.k_proj", "self_attn.v_proj")`) that the layer has and that are `mergeable`, merged;
    returns how many groups were."""
    count = 0
    for layer in layers:
        found = dict(layer.named_modules())
        swaps: dict[str, Any] = {}
        for group in groups:
            modules = [found.get(path) for path in group]
            if all(m is not None for m in modules) and mergeable(modules):
                swaps.update(zip(group, merge(modules), strict=True))  # type: ignore[arg-type]
                count += 1
        if swaps:
            layer.update_modules(tree_unflatten(list(swaps.items())))
    return count

"""The Qwen3.5 family's split by layers over a pipeline's ranks (`pipeline_stage`; GPU thread only).

mlx-vlm's qwen3_5 language model has no pipeline API, so this does what mlx-lm's `PipelineMixin`
does to its own models through the same public attributes: the decoder's `layers` list becomes
this stage's layers (the others' weights are never evaluated when the model was loaded lazily)
and `fa_idx` / `ssm_idx`, the layers whose caches give the masks, index into it (as mlx-lm's
qwen3_5 `pipeline` recomputes them). The model's forward, `make_cache` and our decode step then
run this stage's layers only; `tests/test_pipeline.py` pins that the library forward runs exactly
the list it is given.

Each stage must hold at least one attention layer and one GatedDeltaNet layer: mlx-vlm's forward
takes its masks from both kinds' caches (`UnsupportedSplit` otherwise).
"""

from __future__ import annotations

from typing import Any

from mlx_relay.engine.models.pipeline_stage import UnsupportedSplit, stage_ranges


def pipeline_split(lm: Any, rank: int, size: int, split: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Keep only rank `rank`'s layers (of `size` ranks) in `lm` (in place); the range [start, end)
    of the model's layers it keeps."""
    layers = list(lm.model.layers)
    ranges = stage_ranges(len(layers), size, split)
    start, end = ranges[rank]
    for r, (lo, hi) in enumerate(ranges):  # every rank checks every stage: all refuse the same split
        kinds = {bool(layer.is_linear) for layer in layers[lo:hi]}
        if kinds != {True, False}:
            raise UnsupportedSplit(
                f"rank {r} would run layers {lo}..{hi - 1}, which lack "
                f"{'an attention' if True in kinds else 'a GatedDeltaNet'} layer; each stage needs both kinds "
                f"(fewer processes, or another split)")
    mine = layers[start:end]
    lm.model.layers = mine
    lm.model.fa_idx = next(i for i, layer in enumerate(mine) if not layer.is_linear)
    lm.model.ssm_idx = next(i for i, layer in enumerate(mine) if layer.is_linear)
    return start, end

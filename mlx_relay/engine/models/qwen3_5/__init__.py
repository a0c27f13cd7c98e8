"""The Qwen3.5 family (hybrid GatedDeltaNet + gated attention, dense or mixture of experts, with or
without a vision tower, with an MTP head): the model types it serves (this module imports no MLX).

    layers.py    the decoder's one layer loop over explicit caches (decode step and MTP verify)
    mtp.py       the MTP head: loading it, its input, its layers over explicit caches
    pipeline.py  the split by layers over a pipeline's ranks
    family.py    `FAMILY`, the `models.ModelFamily` the engine calls
"""

from __future__ import annotations

from typing import Final, Literal

#: The model types of the family (checkpoints' and mlx-vlm's language models' own names).
MODEL_TYPES: Final[frozenset[str]] = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"})

#: The library that loads its checkpoints, text-only ones too (`models.Declared`).
LIBRARY: Final[Literal["mlx-vlm"]] = "mlx-vlm"

#: Its images' and videos' preprocessing (`media/served.py`: Qwen-VL's, in numpy), for the
#: checkpoints with a vision tower.
MEDIA_PROCESSOR: Final[str] = "qwen-vl"

#: Text-only model types -> the VLM model type whose MTP splitter reads their `mtp.*` tensors.
TEXT_ONLY_FAMILIES: Final[dict[str, str]] = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}

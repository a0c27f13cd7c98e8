"""The Qwen3.5 family (hybrid GatedDeltaNet + gated attention, dense or mixture of experts, with or
without a vision tower, with an MTP head): the model types it serves (this module imports no MLX).

    layers.py    the decoder's one layer loop over explicit caches (decode step and MTP verify)
    mtp.py       the MTP head: loading it, its input, its layers over explicit caches
    pipeline.py  the split by layers over a pipeline's ranks
    prefill.py   a prefill chunk over the library's caches; mixed.py: a chunk and decoding rows in one forward
    kernels/     its CUDA kernels (GatedDeltaNet, experts), each beside its plain-MLX fallback
    family.py    `FAMILY`, the `models.ModelFamily` the engine calls
"""

from __future__ import annotations

from typing import Any, Final, Literal

from mlx_relay.engine.models.footprint import CacheShape, attention_bytes

#: The model types of the family (checkpoints' and mlx-vlm's language models' own names).
MODEL_TYPES: Final[frozenset[str]] = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"})

#: The library that loads its checkpoints, text-only ones too (`models.Declared`).
LIBRARY: Final[Literal["mlx-vlm"]] = "mlx-vlm"

#: Its images' and videos' preprocessing (`media/served.py`: Qwen-VL's, in numpy), for the
#: checkpoints with a vision tower.
MEDIA_PROCESSOR: Final[str] = "qwen-vl"

#: Text-only model types -> the VLM model type whose MTP splitter reads their `mtp.*` tensors.
TEXT_ONLY_FAMILIES: Final[dict[str, str]] = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}

STATE_BYTES = 4  # the recurrent states are kept in float32


def cache_shape(config: dict[str, Any]) -> CacheShape:
    """A checkpoint's cache bytes (`models.Declared.cache_shape`, the pool's reservation): per token
    its attention layers' keys and values; per row every GatedDeltaNet layer's conv window and SSM
    state, whatever the row's length. The layers' kinds from `layer_types`, else every
    `full_attention_interval`-th layer attention."""
    text = config.get("text_config", config)
    layers = int(text.get("num_hidden_layers", 0))
    kinds = text.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != layers:
        interval = text.get("full_attention_interval")
        kinds = [("full_attention" if interval is None or (i + 1) % int(interval) == 0 else "linear_attention")
                 for i in range(layers)]
    recurrent = sum(kind == "linear_attention" for kind in kinds)
    k_heads, k_dim = int(text.get("linear_num_key_heads", 0)), int(text.get("linear_key_head_dim", 0))
    v_heads, v_dim = int(text.get("linear_num_value_heads", 0)), int(text.get("linear_value_head_dim", 0))
    window = int(text.get("linear_conv_kernel_dim", 4)) - 1
    conv_channels = 2 * k_heads * k_dim + v_heads * v_dim
    per_row = recurrent * (window * conv_channels + v_heads * k_dim * v_dim) * STATE_BYTES
    return CacheShape(per_token=attention_bytes(config, layers - recurrent), per_row=per_row)

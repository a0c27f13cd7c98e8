"""What a model will hold in memory once served, read from its checkpoint's files without MLX:
the weights (the safetensors files' sizes) and its caches' bytes per token and per row (from its
config). The model pool (`mlx_relay/pool/`) reserves a model's memory from this before it loads it.

Per token: every attention layer keeps a key and a value per key-value head. Per row: every
recurrent layer (Qwen3.5's GatedDeltaNet) keeps its convolution window and its SSM state, in
float32, whatever the row's length. A config that says none of this counts every layer as
attention (mlx-lm's text models and mlx-vlm's VLMs that the KV lane serves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

#: bytes per element of a checkpoint's `dtype` / `torch_dtype`
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_STATE_BYTES = 4  # the recurrent states are kept in float32


class CacheShape(msgspec.Struct, frozen=True):
    """One model's cache bytes: per token of a row's context, and per row whatever its length."""

    per_token: int
    per_row: int


class Footprint(msgspec.Struct, frozen=True):
    weights_bytes: int  # the checkpoint's safetensors files (the MTP head's included)
    cache: CacheShape

    def caches_bytes(self, rows: int, tokens_per_row: int) -> int:
        """`rows` rows of `tokens_per_row` tokens each."""
        return rows * (self.cache.per_row + tokens_per_row * self.cache.per_token)


def weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in sorted(path.glob("*.safetensors")))


def cache_shape(config: dict[str, Any]) -> CacheShape:
    """The cache bytes of a checkpoint's config (`config.json`, a VLM's `text_config` read first)."""
    text = config.get("text_config", config)
    layers = int(text.get("num_hidden_layers", 0))
    kinds = text.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != layers:
        interval = text.get("full_attention_interval")
        kinds = [("full_attention" if interval is None or (i + 1) % int(interval) == 0 else "linear_attention")
                 for i in range(layers)]
    attention = sum(kind != "linear_attention" for kind in kinds)
    recurrent = layers - attention
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    width = _DTYPE_BYTES.get(dtype, 2)
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
    per_token = attention * 2 * kv_heads * head_dim * width
    per_row = 0
    if recurrent:
        k_heads, k_dim = int(text.get("linear_num_key_heads", 0)), int(text.get("linear_key_head_dim", 0))
        v_heads, v_dim = int(text.get("linear_num_value_heads", 0)), int(text.get("linear_value_head_dim", 0))
        window = int(text.get("linear_conv_kernel_dim", 4)) - 1
        conv_channels = 2 * k_heads * k_dim + v_heads * v_dim
        per_row = recurrent * (window * conv_channels + v_heads * k_dim * v_dim) * _STATE_BYTES
    return CacheShape(per_token=per_token, per_row=per_row)


def footprint(path: Path, config: dict[str, Any]) -> Footprint:
    return Footprint(weights_bytes=weights_bytes(path), cache=cache_shape(config))

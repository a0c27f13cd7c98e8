"""What a model will hold in memory once served, read from its checkpoint's files without MLX:
the weights (the safetensors files' sizes) and its caches' bytes per token and per row (from its
config). The model pool (`mlx_relay/pool/`) reserves a model's memory from this before it loads it.

Per token: every attention layer keeps a key and a value per key-value head. Per row: what a
model family of the engine's own says its recurrent layers keep whatever the row's length (its
package's `cache_shape`, `models.Declared`: Qwen3.5's GatedDeltaNet its convolution window and
SSM state, in float32). A model of no family counts every layer as attention (mlx-lm's text
models and mlx-vlm's VLMs that the KV lane serves). Keys and values kept quantized (`--kv-bits`)
count at their bits and their groups' scales and biases (`with_kv_bits`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec

from mlx_relay.engine.models import declared
from mlx_relay.engine.models.checkpoint import tensor_shapes
from mlx_relay.engine.models.kv_format import KVQuant

#: bytes per element of a checkpoint's `dtype` / `torch_dtype`
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


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


#: parts of a tensor's name that are not a dense projection of a decoder layer (`dense_copies.py`)
_NOT_DENSE = ("switch_mlp", "experts", "embed_tokens", "lm_head", "mtp", "vision", "visual")


def dense_copy_bytes(path: Path, config: dict[str, Any]) -> int:
    """What `--dense-16bit`'s copies add (`engine/models/dense_copies.py`): 2 bytes an element of
    each quantized dense projection of the decoder layers, its shape read from the safetensors
    files' headers (a weight whose `scales` sit beside it: N rows, K = the scales' groups x the
    checkpoint's `quantization` group size, the projection's own where the config names it)."""
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    shapes = tensor_shapes(path)
    total = 0
    for name, shape in shapes.items():
        if not name.endswith(".weight") or ".layers." not in name or any(p in name for p in _NOT_DENSE):
            continue
        scales = shapes.get(name[: -len("weight")] + "scales")
        if scales is None or len(shape) != 2 or len(scales) != 2:
            continue
        own = quantization.get(name[: -len(".weight")])
        group = int((own if isinstance(own, dict) else quantization).get("group_size", 64))
        total += shape[0] * scales[1] * group * 2
    return total


def cache_shape(config: dict[str, Any]) -> CacheShape:
    """The cache bytes of a checkpoint's config (`config.json`, a VLM's `text_config` read first): its
    family's (`models.Declared.cache_shape`), else every layer an attention layer."""
    text = config.get("text_config", config)
    for model_type in (text.get("model_type"), config.get("model_type")):
        family = declared(str(model_type)) if model_type else None
        if family is not None:
            return family.cache_shape(config)
    return CacheShape(per_token=attention_bytes(config, int(text.get("num_hidden_layers", 0))), per_row=0)


def attention_bytes(config: dict[str, Any], layers: int) -> int:
    """A token's keys and values in `layers` attention layers of a checkpoint's config."""
    text = config.get("text_config", config)
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    width = _DTYPE_BYTES.get(dtype, 2)
    heads = int(text.get("num_attention_heads", 1))
    kv_heads = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
    return layers * 2 * kv_heads * head_dim * width


def with_kv_bits(shape: CacheShape, config: dict[str, Any], kv_bits: int | None) -> CacheShape:
    """`shape` with its per-token bytes (every family's: the attention layers' keys and values) as
    kept quantized at `kv_bits` (`models.kv_quant`: the values at that many bits, and a 16-bit scale
    and bias a group along the head); None: as it is."""
    if kv_bits is None:
        return shape
    text = config.get("text_config", config)
    dtype = str(text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
    width = _DTYPE_BYTES.get(dtype, 2)
    heads = int(text.get("num_attention_heads", 1))
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
    try:
        per_value = KVQuant(kv_bits).bytes_per_value(head_dim, width)
    except ValueError:  # heads MLX cannot quantize: the engine refuses the model (`lane_set`), counted as is
        return shape
    return CacheShape(per_token=math.ceil(shape.per_token * per_value / width), per_row=shape.per_row)


def footprint(path: Path, config: dict[str, Any], kv_bits: int | None = None) -> Footprint:
    return Footprint(weights_bytes=weights_bytes(path), cache=with_kv_bits(cache_shape(config), config, kv_bits))

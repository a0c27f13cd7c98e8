"""The dense Qwen3 family (attention-only text decoders with per-head query and key norms, loaded
by mlx-lm: its `qwen3` model): the model types it serves (this module imports no MLX).

The engine's own plain lane serves it (our restorable prefill, the compiled decode step, mixed
steps, prefix-cache snapshots) where a model of no family of ours runs the library's forward
(`models/library_kv.py`). Every layer keeps keys and values, so its caches are all attention caches.

    layers.py    the decoder's one layer loop over explicit caches (decode step, verify blocks), the head
    prefill.py   a prefill chunk over the library's caches; mixed.py: a chunk and decoding rows in one forward
    family.py    `FAMILY`, the `models.ModelFamily` the engine calls (no MTP head, no pipeline split)
"""

from __future__ import annotations

from typing import Any, Final, Literal

from mlx_relay.engine.models.footprint import CacheShape, attention_bytes

#: The model types of the family (checkpoints' and mlx-lm's language models' own names).
MODEL_TYPES: Final[frozenset[str]] = frozenset({"qwen3"})

#: The library that loads its checkpoints (`models.Declared`).
LIBRARY: Final[Literal["mlx-lm"]] = "mlx-lm"

#: Text only: no media processor.
MEDIA_PROCESSOR: Final[None] = None


def cache_shape(config: dict[str, Any]) -> CacheShape:
    """A checkpoint's cache bytes (`models.Declared.cache_shape`, the pool's reservation): per token
    every layer's keys and values; nothing per row."""
    text = config.get("text_config", config)
    return CacheShape(per_token=attention_bytes(config, int(text.get("num_hidden_layers", 0))), per_row=0)

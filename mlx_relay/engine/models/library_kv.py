"""Families served through the library's own forward over its attention KV caches (GPU thread only):
any text model mlx-lm loads and any VLM mlx-vlm loads whose layers keep only attention keys and
values (Llama, Mistral, Gemma 3, ...; a dense Qwen3 has a family of ours, `qwen3/`).

Our compiled decode step and MTP round need a family's layers over explicit caches
(`models.ModelFamily`, written per family: `qwen3_5/`, `qwen3/`). A model of no such family is still served
exactly when every layer's cache is an attention KV cache: the lane `kv_lane.KVLane` then runs the
library's forward (`lm(ids, cache=...)`) over the library's own caches, batch-1 `KVCache`s while a
row prefills (restorable from, and snapshotted into, the prefix cache: a snapshot is the keys and
values up to a boundary, nothing else) and the library's left-padded `BatchKVCache` while rows
decode together (rows join with `extend`, leave with `filter`, a turn snapshot is `extract`).

What this module knows of a model:
- which library it belongs to (the cache classes are that library's: mlx-lm's and mlx-vlm's are
  different classes with the same public API);
- whether its caches are all attention KV caches (`check`); a sliding-window layer's
  `RotatingKVCache` is served as a full `KVCache` only for the model types listed in
  `WINDOW_MASKED_TYPES`, whose forward builds each sliding layer's window mask itself (from the
  cache's length and the window), so full keys under that mask attend exactly as the rotating
  cache would (it costs the memory of the whole context on those layers). Any other cache (a
  recurrent state, a quantized, chunked or rotating cache elsewhere) is refused at load with
  `UnsupportedModel`, never served wrongly;
- how to run one forward and read its logits (mlx-lm returns the logits, mlx-vlm an output
  object; vision rows feed their prompt embeddings).

`load_text_model` loads a text checkpoint with mlx-lm (a model of no family of ours that mlx-vlm does
not load as a VLM, or of a family that declares mlx-lm: dense Qwen3):
the engine reads `model.language_model` and `model.vision_tower` of what it loads, so the mlx-lm
model is wrapped in `TextModel`, which has both.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Final

import mlx.core as mx

from mlx_relay.engine.models import UnsupportedModel, declared, family_of

__all__ = ["WINDOW_MASKED_TYPES", "KVModel", "TextModel", "check", "load_text_model", "loads_with_mlx_lm",
           "uses_library_forward"]

#: mlx-vlm's language models whose forward masks each sliding layer's window itself (Gemma 3:
#: `create_attention_mask(h, cache, window_size=...)` for the sliding layers).
WINDOW_MASKED_TYPES: Final[frozenset[str]] = frozenset({"gemma3", "gemma3_text"})


class TextModel:
    """An mlx-lm text model as the engine reads a loaded model: its `language_model`, no vision tower."""

    vision_tower = None

    def __init__(self, lm: Any) -> None:
        self.language_model = lm

    def parameters(self) -> Any:
        """Its weights, as a VLM's `parameters()` (a lazily loaded pipeline stage evaluates them)."""
        return self.language_model.parameters()


def loads_with_mlx_lm(config: dict[str, Any]) -> bool:
    """Whether a checkpoint (its config.json) loads with mlx-lm: a text model (no vision tower) of
    no family of our own, or of a family that declares mlx-lm (`models.Declared.library`: dense
    Qwen3's; Qwen3.5's, text-only or not, loads with mlx-vlm)."""
    if config.get("vision_config"):
        return False
    family = declared(str(config.get("model_type")))
    return family is None or family.library == "mlx-lm"


def load_text_model(path: Path, *, lazy: bool = False) -> tuple[TextModel, Any]:
    """The checkpoint's model with mlx-lm (strict: every weight of its architecture) and its
    Hugging Face tokenizer."""
    from mlx_lm.utils import load_model
    from transformers import AutoTokenizer

    try:
        model, _config = load_model(path, lazy=lazy)
    except ValueError as exc:  # mlx-lm's "Model type X not supported."
        raise UnsupportedModel(f"mlx-lm cannot load {path.name}: {exc}") from exc
    return TextModel(model), AutoTokenizer.from_pretrained(str(path))


def _library(lm: Any) -> str:
    root = type(lm).__module__.split(".")[0]
    if root not in ("mlx_lm", "mlx_vlm"):
        raise UnsupportedModel(f"{type(lm).__module__} is neither an mlx-lm nor an mlx-vlm model")
    return root


def _model_type(lm: Any) -> str:
    return str(getattr(lm, "model_type", None) or getattr(getattr(lm, "args", None), "model_type", None)
               or getattr(getattr(lm, "config", None), "model_type", "unknown"))


class KVModel:
    """One language model served through its library's forward over KV caches (`check` first)."""

    def __init__(self, lm: Any) -> None:
        self.lm = lm
        self.library = _library(lm)
        cache = importlib.import_module(f"{self.library}.models.cache")
        self.kv_cache, self.batch_cache = cache.KVCache, cache.BatchKVCache
        self.model_type = _model_type(lm)
        self.layers = check(lm)

    def new_caches(self) -> list[Any]:
        """Empty batch-1 caches, one per layer."""
        return [self.kv_cache() for _ in range(self.layers)]

    def restored(self, entries: list[tuple[str, Any]]) -> list[Any]:
        """Batch-1 caches holding a snapshot's keys and values (views, grown by copy on append)."""
        caches = []
        for kind, value in entries:
            if kind != "kv":
                raise UnsupportedModel(f"a snapshot of a {kind!r} cache cannot restore a {self.model_type} row")
            c = self.kv_cache()
            keys, values = value
            # the public setters: mlx-lm's takes the offset too, mlx-vlm's reads it from the keys
            c.state = (keys, values, keys.shape[2]) if self.library == "mlx_lm" else (keys, values)
            caches.append(c)
        return caches

    def forward(self, ids: mx.array, caches: list[Any], embeds: mx.array | None = None) -> mx.array:
        """Logits [B, T, V] of `ids` [B, T] (or of `embeds` [B, T, D]) through the caches."""
        if self.library == "mlx_lm":
            if embeds is not None:
                raise UnsupportedModel("an mlx-lm text model takes no prompt embeddings")
            return self.lm(ids, cache=caches)
        out = self.lm(ids, inputs_embeds=embeds, cache=caches)
        return out.logits


def check(lm: Any) -> int:
    """The number of layers' caches when every one is an attention KV cache this path serves;
    `UnsupportedModel` saying which layer keeps what otherwise."""
    library = _library(lm)
    cache = importlib.import_module(f"{library}.models.cache")
    model_type = _model_type(lm)
    if "mrope" in repr(getattr(lm, "config", None) or getattr(lm, "args", None)):
        raise UnsupportedModel(f"model type {model_type!r} takes M-RoPE positions, which the library's forward "
                               f"keeps as the model's own state between calls: no batch of rows can share it")
    caches = lm.make_cache() if hasattr(lm, "make_cache") else cache.make_prompt_cache(lm)
    for i, c in enumerate(caches):
        if type(c) is cache.KVCache:
            continue
        if type(c) is cache.RotatingKVCache and model_type in WINDOW_MASKED_TYPES:
            continue
        raise UnsupportedModel(
            f"model type {model_type!r} keeps its layer {i}'s state in {type(c).__name__}: the engine serves a model "
            f"of no family of its own only when every layer keeps attention keys and values (KVCache)")
    if not caches:
        raise UnsupportedModel(f"model type {model_type!r} has no layers with caches")
    return len(caches)


def uses_library_forward(lm: Any) -> bool:
    """False for a language model of a family our own steps serve (`models.family_of`); True for one
    this module serves; `UnsupportedModel` saying why for one neither serves."""
    try:
        family_of(lm)
        return False
    except UnsupportedModel as own:
        try:
            check(lm)
        except UnsupportedModel as generic:
            raise UnsupportedModel(f"{own}; nor through the library's forward: {generic}") from generic
        return True

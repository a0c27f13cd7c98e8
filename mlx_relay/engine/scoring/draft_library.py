"""Which library runs SpecPrefill's draft, and what the draft scorer relies on in it (GPU thread only).

Part of the engine's scoring stage: :class:`mlx_relay.engine.scoring.draft_scorer.DraftScorer` loads
its draft through :func:`load_draft` and reads the draft's caches and attention modules only
through the functions here, so that the scorer works the same on either library's model.

Why two libraries: a Qwen3.5-family draft (hybrid GatedDeltaNet + gated attention) loaded
through mlx-lm prefills its GatedDeltaNet layers off Metal (CUDA, CPU) as a per-token loop of
ops (``mlx_lm.models.gated_delta.gated_delta_update`` -> ``gated_delta_ops``): on an H200 that
made scoring an 8K prompt take 10 s, longer than the target's whole prefill. mlx-vlm's
qwen3_5 language model takes a chunked parallel scan there instead
(``mlx_vlm.models.qwen3_5.gated_delta.gated_delta_update`` -> ``gated_delta_chunked`` for
T > 1 when no Metal kernel is available), the same recurrence in far fewer sequential steps.
So a qwen3_5-family draft (config ``model_type`` qwen3_5 / qwen3_5_moe / their ``_text``
forms, or a VLM checkpoint whose ``text_config`` is one) is loaded with ``mlx_vlm.load`` and
scored through its ``language_model``; every other draft (dense Qwen3, llama, ...) keeps
``mlx_lm.load``.

Where the two libraries differ, and what is relied on (pinned in tests/test_draft_library.py,
public attributes only):

* caches: both libraries' ``KVCache`` keep post-RoPE keys and an int ``offset``; mlx-lm's
  ``state`` is ``(keys, values, offset)`` with the whole preallocated buffer, mlx-vlm's is
  ``(keys, values)`` already trimmed to the offset. :func:`cached_keys_values` slices both to
  ``offset``. GatedDeltaNet layers have an ``ArraysCache`` in both (never probed).
* caches are made by the model itself: mlx-lm's ``make_prompt_cache``; mlx-vlm's
  ``LanguageModel.make_cache()``.
* RoPE: mlx-lm's attention has ``rope(x, offset=)``; mlx-vlm's qwen3_5 attention has
  ``rotary_emb.apply_rotary(q, k, position_ids)`` (multimodal RoPE) and, when called without
  position ids (as the scorer's backbone call does), rotates positions
  ``offset .. offset + L`` on all three MRoPE axes; :func:`rotate_queries` does the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache as LmKVCache
from mlx_lm.models.cache import make_prompt_cache
from mlx_vlm.models.cache import KVCache as VlmKVCache

from mlx_relay.engine.models import declared

__all__ = [
    "DraftLibrary",
    "LoadedDraft",
    "cache_arrays",
    "cached_keys_values",
    "draft_library",
    "has_rotation",
    "is_attention_cache",
    "load_draft",
    "make_cache",
    "read_config",
    "rotate_queries",
]

DraftLibrary = Literal["mlx-lm", "mlx-vlm"]

_ATTENTION_CACHES: Final[tuple[type, ...]] = (LmKVCache, VlmKVCache)


def read_config(path: Path) -> dict[str, Any]:
    """The checkpoint's ``config.json`` ({} when it is missing or unreadable: the load reports it)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def draft_library(config: dict[str, Any]) -> DraftLibrary:
    """The library of the engine's family that serves the checkpoint (itself or its ``text_config``),
    as it declares it (Qwen3.5's: mlx-vlm, the chunked GatedDeltaNet prefill off Metal), else mlx-lm."""
    text_config = config.get("text_config")
    types = [config.get("model_type")]
    if isinstance(text_config, dict):
        types.append(text_config.get("model_type"))
    libraries = [d.library for t in types if isinstance(t, str) and (d := declared(t)) is not None]
    return libraries[0] if libraries else "mlx-lm"


@dataclass(frozen=True)
class LoadedDraft:
    model: nn.Module  # the text model: ``layers``, a ``model`` backbone, logits when called
    tokenizer: Any  # a tokenizer wrapper or a processor (its ``tokenizer``)
    library: DraftLibrary
    model_type: str


def load_draft(path: Path, library: DraftLibrary | None = None) -> LoadedDraft:
    """Load the draft at ``path`` with ``library`` (default: :func:`draft_library` of its
    config). Library errors propagate; the caller turns them into its load error."""
    config = read_config(path)
    library = library or draft_library(config)
    if library == "mlx-vlm":
        import mlx_vlm

        vlm, processor = mlx_vlm.load(str(path))
        # the text model alone: the vision tower is not kept (nothing else references it)
        model = vlm.language_model
    else:
        import mlx_lm

        model, processor = mlx_lm.load(str(path))[:2]
    model_type = config.get("model_type") or getattr(model, "model_type", None) or "unknown"
    return LoadedDraft(model, processor, library, str(model_type))


def make_cache(model: nn.Module) -> list[Any]:
    """A fresh cache per layer, as the model's library makes it (mlx-lm's ``make_prompt_cache``
    defers to the model's ``make_cache`` when it has one, as mlx-vlm's language models do)."""
    return list(make_prompt_cache(model))


def is_attention_cache(cache: Any) -> bool:
    """A plain full-attention KV cache of either library (not rotating, quantized or batched)."""
    return type(cache) in _ATTENTION_CACHES


def cached_keys_values(cache: Any) -> tuple[mx.array, mx.array, int]:
    """The post-RoPE keys and values of every position so far, and how many there are."""
    state = cache.state
    offset = int(cache.offset)
    return state[0][..., :offset, :], state[1][..., :offset, :], offset


def cache_arrays(caches: list[Any]) -> list[mx.array]:
    """Every array the caches hold (to evaluate a chunk's work before the next step)."""
    arrays: list[mx.array] = []
    for cache in caches:
        state = cache.state
        items = state if isinstance(state, (list, tuple)) else [state]
        arrays.extend(item for item in items if isinstance(item, mx.array))
    return arrays


def has_rotation(attn: nn.Module) -> bool:
    """Whether :func:`rotate_queries` knows how ``attn`` applies RoPE."""
    if getattr(attn, "rope", None) is not None:
        return True
    return callable(getattr(getattr(attn, "rotary_emb", None), "apply_rotary", None))


def rotate_queries(attn: nn.Module, queries: mx.array, offset: int) -> mx.array:
    """``queries`` (B, heads, L, head_dim) rotated as ``attn`` rotates them at positions
    ``offset .. offset + L`` (text positions: every MRoPE axis the same)."""
    rope = getattr(attn, "rope", None)
    if rope is not None:
        return rope(queries, offset=offset)
    L = queries.shape[2]
    position_ids = mx.tile(mx.arange(offset, offset + L)[None, :], (3, 1, 1))
    rotated, _ = attn.rotary_emb.apply_rotary(queries, queries, position_ids, unsqueeze_dim=1)
    return rotated

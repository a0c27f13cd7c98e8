"""Whose images the server serves (no MLX): each VLM family with a media processor of its own
(`media/processor.py`), by the checkpoint's model type. A VLM of another family loads and answers
text; a request with images or video gets a 400 that says why, and `/v1/models` does not claim
vision for it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Final

from mlx_relay.engine.models import declarations
from mlx_relay.media.gemma3 import load_gemma3_processor
from mlx_relay.media.preprocess import load_vision_processor
from mlx_relay.media.processor import MediaProcessor

__all__ = ["MEDIA_PROCESSORS", "load_media_processor", "unserved_vision"]

#: A media processor's kind (as a model family declares it: `engine.models.Declared`) -> its loader.
LOADERS: Final[Mapping[str, Callable[[Path], MediaProcessor]]] = MappingProxyType({"qwen-vl": load_vision_processor})

#: A checkpoint's model type -> its media processor's loader (runs in a worker thread): the engine's
#: families' as they declare them, and Gemma 3's (served through its library's forward).
MEDIA_PROCESSORS: Final[Mapping[str, Callable[[Path], MediaProcessor]]] = MappingProxyType(
    {t: LOADERS[d.media_processor] for d in declarations() if d.media_processor for t in d.model_types}
    | {"gemma3": load_gemma3_processor})


def _config(model_path: Path) -> dict:
    return json.loads((model_path / "config.json").read_text())


def unserved_vision(model_path: Path) -> str | None:
    """Why the checkpoint's vision tower is not served (None: it has none, or it is served)."""
    config = _config(model_path)
    model_type = config.get("model_type")
    if not config.get("vision_config") or model_type in MEDIA_PROCESSORS:
        return None
    served = ", ".join(sorted(MEDIA_PROCESSORS))
    return (f"images and video are not served for model type {model_type!r} yet (the server preprocesses "
            f"media for {served} only): send text only")


def load_media_processor(model_path: Path) -> MediaProcessor | None:
    """The checkpoint's media processor; None for a checkpoint without a vision tower or one not served."""
    config = _config(model_path)
    loader = MEDIA_PROCESSORS.get(str(config.get("model_type")))
    return loader(model_path) if config.get("vision_config") and loader is not None else None

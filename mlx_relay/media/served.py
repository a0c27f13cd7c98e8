"""Whose images the server serves (no MLX): the media path (`media/qwen_vl.py`'s preprocessing, the
engine's M-RoPE vision rows) is the Qwen3.5 family's. A VLM of another family (Gemma 3, served as
text through `engine/models/library_kv.py`) loads and answers text; a request with images or video
gets a 400 that says why, and `/v1/models` does not claim vision for it.
"""

from __future__ import annotations

import json
from pathlib import Path

from mlx_relay.engine.models.qwen3_5 import MODEL_TYPES as QWEN3_5_TYPES

__all__ = ["unserved_vision"]


def unserved_vision(model_path: Path) -> str | None:
    """Why the checkpoint's vision tower is not served (None: it has none, or it is served)."""
    config = json.loads((model_path / "config.json").read_text())
    model_type = config.get("model_type")
    if not config.get("vision_config") or model_type in QWEN3_5_TYPES:
        return None
    return (f"images and video are not served for model type {model_type!r} yet (the server preprocesses "
            f"media for the Qwen3.5 family only): send text only")

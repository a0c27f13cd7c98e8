"""What a checkpoint's files say, read without MLX: where it is, its config, its context length,
its end-of-sequence ids, whether it carries an MTP head. The server's process uses these (its
engine may run in another process, where `loader.py` loads the model with MLX)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_relay.errors import ModelLoadError


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory, or a Hub repo id fetched into the local HF cache."""
    path = Path(model).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(
                snapshot_download(
                    model,
                    allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py"],
                )
            )
        except Exception as exc:
            raise ModelLoadError(f"{model} is neither a local directory nor a reachable Hub repo: {exc}") from exc
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a model checkpoint (no config.json)")
    return path.resolve()


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def context_length(config: dict[str, Any]) -> int:
    text = config.get("text_config", config)
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        if key in text:
            return int(text[key])
    return 4096


def eos_token_ids(config: dict[str, Any]) -> list[int]:
    eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def tensor_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the checkpoint's safetensors files (their headers only, no data)."""
    shapes: dict[str, list[int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes |= {name: meta["shape"] for name, meta in header.items() if name != "__metadata__"}
    return shapes


def has_mtp_weights(path: Path) -> bool:
    """Whether the checkpoint carries an `mtp.*` head (reads only the safetensors headers)."""
    return any(key.startswith("mtp.") for key in tensor_shapes(path))


#: why an embedding checkpoint is not served as a model of its own
EMBEDDING_ALONE = ("an embedding model is served beside a chat model: --embedding-model PATH (or `embedding_model` in "
                   "a chat model's table of the models file), not as a model of its own")

#: sentence-transformers' pooling modes (`1_Pooling/config.json`'s `pooling_mode_*` flags), as named here
POOLING_MODES = ("lasttoken", "mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens")


def embedding_pooling(path: Path) -> str | None:
    """The pooling an embedding checkpoint declares (a sentence-transformers layout: `modules.json`
    with a Pooling module, its config's `pooling_mode_*` flag: "lasttoken", "mean_tokens", ...), or
    None when the checkpoint is not an embedding model's."""
    modules = path / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if str(module.get("type", "")).endswith("models.Pooling"):
            config = path / str(module.get("path", "")) / "config.json"
            flags = json.loads(config.read_text()) if config.is_file() else {}
            return next((mode for mode in POOLING_MODES if flags.get(f"pooling_mode_{mode}")), "mean_tokens")
    return None

"""Model loading (GPU thread only) and the facts other actors need about the model.

Resolves a Hugging Face repo id or local directory, loads the VLM with mlx-vlm and reports a
`ModelInfo`. Called only from the GPUExecutor's thread.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_vlm

from mlx_relay.config import EngineConfig
from mlx_relay.errors import ModelLoadError
from mlx_relay.messages.gpu import ModelInfo


def detect_backend() -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


#: Share of the device's memory the prefix cache may hold by default: of the recommended
#: working set (Metal) or the device memory (CUDA), or of RAM on the CPU backend.
PREFIX_CACHE_SHARE_GPU = 0.2
PREFIX_CACHE_SHARE_RAM = 0.1


def device_memory_bytes() -> tuple[int, bool]:
    """(bytes, on a GPU): the recommended working set (Metal) or the device memory (CUDA), else
    the machine's RAM (CPU backend). Runs on the GPU thread: it asks MLX."""
    import os

    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info()) if hasattr(mx, "device_info") else dict(mx.metal.device_info())
    except Exception:
        info = {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value, True
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), False


def default_prefix_cache_bytes() -> int:
    """The prefix cache's default byte budget (runs on the GPU thread)."""
    total, gpu = device_memory_bytes()
    return int(total * (PREFIX_CACHE_SHARE_GPU if gpu else PREFIX_CACHE_SHARE_RAM))


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


def has_mtp_weights(path: Path) -> bool:
    """Whether the checkpoint carries an `mtp.*` head (reads only the safetensors headers)."""
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        if any(key.startswith("mtp.") for key in header):
            return True
    return False


@dataclass
class LoadedModel:
    model: Any  # mlx_vlm Model
    processor: Any  # mlx_vlm processor (tokenizer + image processor)
    info: ModelInfo


#: MLX's buffer cache on CUDA unless --cache-limit-gb says otherwise: this, or a tenth of the
#: device if that is less. MLX's own default is its memory limit (95% of the device): during a
#: 64-stream burst on an H200 it kept ~90 GB of freed buffers (the CUDA pool peaked at 142.6 GB for
#: 50.9 GB of arrays); capped at 8 GiB the pool peaked at 62.6 GB at the same 220 tok/s
#: (benchmarks/results/gpu-h200-2026-11-25/).
CUDA_CACHE_LIMIT_BYTES = 8 << 30


def apply_memory_limits(config: EngineConfig) -> None:
    """Set MLX's process-wide memory and buffer-cache limits (on the GPU thread, before loading)."""
    if config.memory_limit_bytes is not None:
        mx.set_memory_limit(config.memory_limit_bytes)
    if config.cache_limit_bytes is not None:
        mx.set_cache_limit(config.cache_limit_bytes)
    elif detect_backend() == "cuda":
        mx.set_cache_limit(min(CUDA_CACHE_LIMIT_BYTES, device_memory_bytes()[0] // 10))


def load_model(path: Path, *, lazy: bool = False) -> LoadedModel:
    """Load on the calling thread (which must be the GPU thread); `lazy`: the weights are read when
    first evaluated (a pipeline stage evaluates only its own layers')."""
    tic = time.perf_counter()
    config = read_config(path)
    model, processor = mlx_vlm.load(str(path), lazy=lazy)
    tokenizer = processor.tokenizer if hasattr(processor, "tokenizer") else processor
    text_cfg = config.get("text_config", config)
    info = ModelInfo(
        model_path=str(path),
        model_type=str(config.get("model_type", "unknown")),
        backend=detect_backend(),  # type: ignore[arg-type]
        context_length=context_length(config),
        vocab_size=len(tokenizer),
        eos_token_ids=eos_token_ids(config),
        has_vision=getattr(model, "vision_tower", None) is not None,
        has_mtp=int(text_cfg.get("mtp_num_hidden_layers", 0) or 0) > 0 and has_mtp_weights(path),
        load_seconds=time.perf_counter() - tic,
    )
    return LoadedModel(model, processor, info)

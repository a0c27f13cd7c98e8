"""Model loading (GPU thread only) and the facts other actors need about the model.

Resolves a Hugging Face repo id or local directory, loads the VLM with mlx-vlm (a text checkpoint
of no family of ours, or of a family that declares mlx-lm, with mlx-lm: `models.library_kv`) and
reports a `ModelInfo`. Called only from the GPUExecutor's thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_vlm

from mlx_relay.config import EngineConfig
from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.checkpoint import (
    EMBEDDING_ALONE,
    context_length,
    embedding_pooling,
    eos_token_ids,
    has_mtp_weights,
    read_config,
)
from mlx_relay.engine.models.dense_copies import add_dense_copies
from mlx_relay.engine.models.library_kv import load_text_model, loads_with_mlx_lm, uses_library_forward
from mlx_relay.engine.models.merged_projections import merge_projections
from mlx_relay.errors import ModelLoadError
from mlx_relay.media.served import unserved_vision
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


def prefix_cache_budget(config: EngineConfig) -> int:
    """The prefix cache's byte budget (0: off); every rank of a pipeline must agree on whether it is on."""
    if not config.prefix_cache:
        return 0
    return config.prefix_cache_bytes if config.prefix_cache_bytes is not None else default_prefix_cache_bytes()


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


def load_model(path: Path, *, lazy: bool = False, merge: bool = True) -> LoadedModel:
    """Load on the calling thread (which must be the GPU thread); `lazy`: the weights are read when
    first evaluated (a pipeline stage evaluates only its own layers': `add_copies` merges them);
    `merge`: the projections of one input merged as the family names (`merged_projections.py`; off:
    the checkpoint's modules as the library loads them, for a benchmark's other side)."""
    tic = time.perf_counter()
    if embedding_pooling(path) is not None:
        raise ModelLoadError(f"{path}: {EMBEDDING_ALONE}")
    config = read_config(path)
    if loads_with_mlx_lm(config):  # a text model of no family of ours, or of one that declares mlx-lm
        model, processor = load_text_model(path, lazy=lazy)
    else:
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
        has_vision=getattr(model, "vision_tower", None) is not None and unserved_vision(path) is None,
        has_mtp=int(text_cfg.get("mtp_num_hidden_layers", 0) or 0) > 0 and has_mtp_weights(path),
        load_seconds=time.perf_counter() - tic,
    )
    loaded = LoadedModel(model, processor, info)
    if merge and not lazy:
        merge_family_projections(loaded)
    return loaded


def merge_family_projections(loaded: LoadedModel) -> int:
    """Merge the projections of one input that the model's family names (`merged_projections.py`),
    in the layers `loaded` holds; how many groups were merged (none for a model served through its
    library's forward, or already merged)."""
    lm = loaded.model.language_model
    if uses_library_forward(lm):
        return 0
    family = family_of(lm)
    return merge_projections(family.layers(lm), family.merged_groups)


def add_copies(loaded: LoadedModel, config: EngineConfig) -> int:
    """The weights' load-time copies `config` asks for, in the layers `loaded` holds (a pipeline
    stage's own, once sharded), before the rows' memory is planned: a 16-bit copy of each dense 8-bit
    projection (`dense_copies.py`, `EngineConfig.dense_16bit`), for a model of the engine's own
    families, then the family's merged projections where a lazy load left them out. The bytes added."""
    lm = loaded.model.language_model
    if uses_library_forward(lm):
        return 0
    added = add_dense_copies(family_of(lm).layers(lm)) if config.dense_16bit else 0
    merge_family_projections(loaded)  # a pipeline stage's layers, loaded lazily (copies are not merged)
    return added

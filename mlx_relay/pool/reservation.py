"""What a model reserves against the pool's memory budget, and which loaded models make room.

A model's reservation (`Reservation`) is counted from its files and settings before it loads: its
weights (the checkpoint's safetensors, and SpecPrefill's draft model's), its prefix cache's budget,
`max_num_seqs` rows at its whole context length (attention keys and values per token, recurrent
states per row: `engine/models/footprint.py`) and MLX's buffer cache limit. `make_room` is the
pool's one decision, a pure function: the idle, unpinned models to unload (least recently used
first) so that a model fits, or None when it cannot fit now.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from mlx_relay.config import EngineConfig, ServerConfig
from mlx_relay.engine.models.checkpoint import context_length, read_config
from mlx_relay.engine.models.footprint import dense_copy_bytes, footprint, weights_bytes
from mlx_relay.pool.config import Reservation

#: a pooled model's prefix cache and MLX buffer cache, when not given, as shares of the budget
PREFIX_CACHE_SHARE = 1 / 8
BUFFER_CACHE_SHARE = 1 / 16


def pooled_engine(engine: EngineConfig, budget_bytes: int | None) -> EngineConfig:
    """A model's engine as the pool runs it: in a process of its own (its memory is the process's,
    and unloading it ends the process), its prefix cache and MLX's buffer cache bounded by shares
    of the budget unless given. `ValueError` for `engine_process="off"` (two engines in one process
    would share MLX's device and its allocator)."""
    if engine.engine_process == "off":
        raise ValueError("several models run each engine in a process of its own: --engine-process off "
                         "cannot serve a pool")
    changes: dict[str, object] = {"engine_process": "on"}
    if budget_bytes is not None:
        if engine.prefix_cache and engine.prefix_cache_bytes is None:
            changes["prefix_cache_bytes"] = int(budget_bytes * PREFIX_CACHE_SHARE)
        if engine.cache_limit_bytes is None:
            changes["cache_limit_bytes"] = int(budget_bytes * BUFFER_CACHE_SHARE)
    return msgspec.structs.replace(engine, **changes)  # type: ignore[arg-type]


def reservation_for(config: ServerConfig, path: Path, draft_path: Path | None = None) -> Reservation:
    """A model's reservation from its checkpoint at `path` (resolved) and its settings."""
    checkpoint = read_config(path)
    engine = config.engine
    shape = footprint(path, checkpoint, engine.kv_bits)
    tokens = context_length(checkpoint)
    if engine.max_model_len is not None:
        tokens = min(tokens, engine.max_model_len)
    return Reservation(
        weights_bytes=shape.weights_bytes + (weights_bytes(draft_path) if draft_path is not None else 0)
        + (dense_copy_bytes(path, checkpoint) if engine.dense_16bit else 0)
        + (weights_bytes(Path(engine.embedding_model)) if engine.embedding_model else 0),
        prefix_cache_bytes=(engine.prefix_cache_bytes or 0) if engine.prefix_cache else 0,
        decode_bytes=shape.caches_bytes(engine.max_num_seqs, tokens),
        buffer_cache_bytes=engine.cache_limit_bytes or 0,
    )


class Resident(msgspec.Struct, frozen=True):
    """A model that holds (or is about to hold) memory, as `make_room` sees it."""

    name: str
    reserved: int  # bytes counted against the budget
    evictable: bool  # loaded, unpinned and no request using or waiting for it
    last_used: float  # monotonic time of its last request


def make_room(need: int, resident: Sequence[Resident], budget: int | None) -> list[str] | None:
    """The models to unload, least recently used first, so that `need` more bytes fit the budget
    beside what stays; [] when it fits already; None when even unloading every evictable model
    would not make room (the caller waits or refuses)."""
    if budget is None:
        return []
    free = budget - sum(r.reserved for r in resident)
    victims: list[str] = []
    for r in sorted((r for r in resident if r.evictable), key=lambda r: r.last_used):
        if free >= need:
            break
        victims.append(r.name)
        free += r.reserved
    return victims if free >= need else None

"""The pool's configuration built whole from the operator's entries (`models_file.py`) and the
server's flags: each model's `ServerConfig` (the flags, then its own settings), its engine as the
pool runs it, its reservation; errors name the entry's line (or flag)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from mlx_relay.config import ServerConfig, build_config
from mlx_relay.engine.models.checkpoint import (
    EMBEDDING_ALONE,
    context_length,
    embedding_pooling,
    read_config,
    resolve_model_path,
)
from mlx_relay.errors import ModelLoadError
from mlx_relay.pool.config import PoolConfig, PooledModel
from mlx_relay.pool.models_file import ModelsConfigError, NamedEntry
from mlx_relay.pool.reservation import pooled_engine, reservation_for


def pooled_model(config: ServerConfig, *, pinned: bool = False, idle_ttl_s: float | None = None,
                 budget: int | None = None) -> PooledModel:
    """One model as the pool serves it: `config` (its checkpoint resolved), its engine as
    `pooled_engine` runs it, its reservation and context length from its files."""
    path = Path(config.engine.model_path)
    engine = pooled_engine(config.engine, budget)
    config = msgspec.structs.replace(config, engine=engine)
    draft = config.specprefill.draft_model
    ctx = context_length(read_config(path))
    if engine.max_model_len is not None:
        ctx = min(ctx, engine.max_model_len)
    return PooledModel(config, reservation_for(config, path, Path(draft) if draft else None),
                       pinned=pinned, idle_ttl_s=idle_ttl_s, context_length=ctx)


def pool_config(entries: Sequence[NamedEntry], overrides: dict[str, Any], *, budget: int | None,
                default_idle_ttl_s: float | None = None, load_wait_s: float = 120.0,
                contention: Literal["wait", "fail"] = "wait", drain_timeout_s: float = 30.0) -> PoolConfig:
    """Every entry's model, served with `overrides` (the server's flags, as `build_config` takes
    them) and then its own settings. `ModelsConfigError` naming the entry's line for a path that
    is not a model, a setting out of range or a model that cannot fit the budget."""
    models = []
    flag_aliases = tuple(overrides.get("model_aliases", ()))
    overrides = {k: v for k, v in overrides.items() if k != "model_aliases"}
    for index, named in enumerate(entries):
        entry = named.entry
        try:
            path = resolve_model_path(entry.path)
        except ModelLoadError as exc:
            raise ModelsConfigError(f"{named.path_where}: models.{named.name}: {exc}") from None
        if embedding_pooling(path) is not None:
            raise ModelsConfigError(f"{named.path_where}: models.{named.name}: {EMBEDDING_ALONE}")
        settings = {**overrides, **entry.overrides()}
        try:
            draft = settings.get("specprefill_draft_model")
            if draft:
                settings["specprefill_draft_model"] = str(resolve_model_path(draft))
            if embed := settings.get("embedding_model"):  # named as given, counted where it is
                given = embed.rstrip("/").rsplit("/", 1)[-1]
                settings["embedding_model_name"] = settings.get("embedding_model_name") or given
                settings["embedding_model"] = str(resolve_model_path(embed))
            aliases = (*(flag_aliases if index == 0 else ()), *entry.aliases)  # --model-alias: the first model's
            config = build_config(path, served_model_name=named.name, model_aliases=aliases, **settings)
            models.append(pooled_model(config, pinned=entry.pinned,
                                       idle_ttl_s=entry.idle_ttl_s if entry.idle_ttl_s is not None
                                       else default_idle_ttl_s, budget=budget))
        except (ValueError, TypeError, ModelLoadError) as exc:
            raise ModelsConfigError(f"{named.where}: models.{named.name}: {exc}") from None
        if (problem := over_budget(models[-1], budget)) is not None:
            raise ModelsConfigError(f"{named.where}: {problem}")
    pinned = [m for m in models if m.pinned]
    if budget is not None and sum(m.reservation.total for m in pinned) > budget:
        raise ModelsConfigError(f"the pinned models ({', '.join(m.name for m in pinned)}) reserve "
                                f"{gib(sum(m.reservation.total for m in pinned))} together, more than the memory "
                                f"budget of {gib(budget)}")
    return PoolConfig(tuple(models), memory_budget_bytes=budget, load_wait_s=load_wait_s, contention=contention,
                      drain_timeout_s=drain_timeout_s)


def over_budget(model: PooledModel, budget: int | None) -> str | None:
    """Why `model` can never load under `budget` (None: it can)."""
    r = model.reservation
    if budget is None or r.total <= budget:
        return None
    return (f"the model '{model.name}' reserves {gib(r.total)} (weights {gib(r.weights_bytes)}, decode caches "
            f"{gib(r.decode_bytes)}, prefix cache {gib(r.prefix_cache_bytes)}, MLX buffers "
            f"{gib(r.buffer_cache_bytes)}), more than the memory budget of {gib(budget)}: raise the budget, or "
            "lower its max_num_seqs, max_model_len or prefix cache")


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"

"""The server's own bodies (msgspec), apart from every wire format: `GET /health`,
`/v1/models` (with a pool's `POST /v1/models/{name}/load` and `/unload`) and `POST /v1/cache/flush`
(`http/app.py`)."""

from __future__ import annotations

from typing import Literal

import msgspec


class ModelCapabilities(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the served model takes and does (a router picks a backend by these)."""

    vision: bool  # image and video inputs
    tools: bool  # tool calls (the chat template teaches a tool-call syntax the replies are parsed for)
    reasoning: bool  # thinking blocks, returned as reasoning apart from the content
    embeddings: bool = False  # an embedding model (`/v1/embeddings`), not a chat model (only written when true)


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlx-relay"
    object: Literal["model"] = "model"
    context_length: int | None = None  # prompt and reply together, in tokens (None: still loading)
    max_model_len: int | None = None  # the same, by vLLM's name
    capabilities: ModelCapabilities | None = None  # None: still loading


class ModelMemory(msgspec.Struct, frozen=True):
    """A pooled model's memory: what it is counted for against the budget (`pool/reservation.py`)
    and, while loaded, what its engine's allocator holds."""

    reserved_bytes: int  # weights + prefix cache + decode caches + MLX's buffer cache
    weights_bytes: int
    prefix_cache_bytes: int
    decode_bytes: int  # max_num_seqs rows at the context length
    buffer_cache_bytes: int
    active_bytes: int | None = None  # MLX's arrays now (None: not loaded)
    peak_bytes: int | None = None  # the most it held since it loaded


class PooledModelCard(ModelCard, kw_only=True):
    """`/v1/models` of a server of several models: every configured model, loaded or not."""

    state: Literal["unloaded", "loading", "ready", "unloading", "failed"]
    pinned: bool
    aliases: list[str]
    memory: ModelMemory
    running: int = 0  # requests whose responses it is serving
    waiting: int = 0  # requests waiting for it to be loaded (or for room, or for their turn)
    idle_ttl_s: float | None = None
    last_used: float | None = None  # unix time of its last request (None: none yet)
    loaded_at: float | None = None  # unix time it became ready (None: not loaded)
    error: str | None = None  # why its last load failed


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class HealthBody(msgspec.Struct, omit_defaults=True):
    """`GET /health`: 200 only when ready; what a load balancer needs to route by in every state."""

    status: Literal["loading", "warming", "ready", "degraded", "draining", "failed"]
    model: str
    backend: str | None = None
    running: int | None = None  # requests holding a slot
    queued: int | None = None  # requests waiting for one
    max_num_seqs: int | None = None  # slots (sequences decoded at once)
    max_queue: int | None = None  # waiting requests beyond which new ones get 429
    down: dict[str, str] | None = None  # actors not running now: name -> restarting / failed
    error: str | None = None  # why the server failed
    models: dict[str, str] | None = None  # a pool's models: name -> unloaded / loading / ready / unloading / failed


class FlushBody(msgspec.Struct):
    """`POST /v1/cache/flush`."""

    flushed_entries: int
    flushed_bytes: int


class LoadModelBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /v1/models/{name}/load`'s optional body: a model the server was not started with, by
    its local checkpoint directory (served with the server's flags), and how the pool treats it."""

    path: str | None = None
    aliases: list[str] = []
    pinned: bool = False
    idle_ttl_s: float | None = None

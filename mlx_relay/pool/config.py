"""The model pool's typed configuration, built once by the CLI (or a test) and passed down whole:
each model's own `ServerConfig` (its engine, prompts, SpecPrefill, aliases) with how the pool
treats it (pinned, idle TTL, its memory reservation), and the pool's budget and contention policy.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mlx_relay.config import ServerConfig


class Reservation(msgspec.Struct, frozen=True):
    """What a model is counted for against the budget before it loads (`reservation.py`)."""

    weights_bytes: int  # its checkpoint's weights (and SpecPrefill's draft model's)
    prefix_cache_bytes: int  # its prefix cache's memory budget
    decode_bytes: int  # max_num_seqs rows at its context length (attention KV + recurrent states)
    buffer_cache_bytes: int  # freed buffers MLX keeps for reuse (its cache limit)

    @property
    def total(self) -> int:
        return self.weights_bytes + self.prefix_cache_bytes + self.decode_bytes + self.buffer_cache_bytes


class PooledModel(msgspec.Struct, frozen=True):
    """One served model: its whole config (`config.served_model_name` is its name, its
    `model_aliases` the other names requests may use) and how the pool treats it."""

    config: ServerConfig
    reservation: Reservation
    pinned: bool = False  # loaded at start and never unloaded but by hand (or the server's drain)
    idle_ttl_s: float | None = None  # unloaded after this long without a request; None: never
    context_length: int | None = None  # its checkpoint's (or max_model_len), for its card before it loads

    @property
    def name(self) -> str:
        return self.config.served_model_name


class PoolConfig(msgspec.Struct, frozen=True):
    models: tuple[PooledModel, ...]  # the first is the one a request that names no model gets
    memory_budget_bytes: int | None = None  # weights + caches of every loaded model; None: no budget
    load_wait_s: float = 120.0  # how long a request waits for its model to load (then 503 + Retry-After)
    # a model that does not fit beside the loaded ones once the idle unpinned ones are unloaded:
    # "wait" (for one to become idle, within load_wait_s) or "fail" (503 + Retry-After at once)
    contention: Literal["wait", "fail"] = "wait"
    drain_timeout_s: float = 30.0  # an unloading model's streams may finish within this; the rest are ended

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("PoolConfig.models must name at least one model")
        if not self.load_wait_s >= 0:
            raise ValueError("PoolConfig.load_wait_s must not be negative")

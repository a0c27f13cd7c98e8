"""Typed configuration: built once from the CLI (or the in-process API) and passed down.

Nothing reads the environment or module globals later; each actor gets the struct it needs.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class EngineConfig(msgspec.Struct, frozen=True):
    """What the GPUExecutor loads and how it batches."""

    model_path: str
    max_num_seqs: int = 16
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    warmup: bool = True
    seed: int = 0  # seeds the per-request sampling seeds of requests that give none


class AdmissionConfig(msgspec.Struct, frozen=True):
    max_num_seqs: int = 16
    max_queue: int = 64
    max_prompt_bytes: int = 32 * 1024 * 1024


class ServerConfig(msgspec.Struct, frozen=True):
    """Everything `mlx-relay serve` needs."""

    model: str
    served_model_name: str
    engine: EngineConfig
    admission: AdmissionConfig = AdmissionConfig()
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    default_max_tokens: int = 4096
    sse_keepalive_s: float = 10.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"

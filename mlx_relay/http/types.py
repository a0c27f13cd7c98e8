"""The server's own bodies (msgspec), apart from every wire format: `GET /health`,
`/v1/models` and `POST /v1/cache/flush` (`http/app.py`)."""

from __future__ import annotations

from typing import Literal

import msgspec


class ModelCapabilities(msgspec.Struct, frozen=True):
    """What the served model takes and does (a router picks a backend by these)."""

    vision: bool  # image and video inputs
    tools: bool  # tool calls (the chat template teaches a tool-call syntax the replies are parsed for)
    reasoning: bool  # thinking blocks, returned as reasoning apart from the content


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "mlx-relay"
    object: Literal["model"] = "model"
    context_length: int | None = None  # prompt and reply together, in tokens (None: still loading)
    max_model_len: int | None = None  # the same, by vLLM's name
    capabilities: ModelCapabilities | None = None  # None: still loading


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


class FlushBody(msgspec.Struct):
    """`POST /v1/cache/flush`."""

    flushed_entries: int
    flushed_bytes: int

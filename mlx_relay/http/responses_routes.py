"""OpenAI Responses API (`POST /v1/responses`, as Codex uses it) over `ChatService.reply`."""

from __future__ import annotations

from collections.abc import Callable

from starlette.routing import Route

from mlx_relay.config import ServerConfig
from mlx_relay.service import ChatService


def responses_routes(config: ServerConfig, service: Callable[[], ChatService],
                     check_model: Callable[[str | None], str]) -> list[Route]:
    return []

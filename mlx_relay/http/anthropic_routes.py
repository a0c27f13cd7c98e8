"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) over `ChatService.reply`."""

from __future__ import annotations

from collections.abc import Callable

from starlette.routing import Route

from mlx_relay.config import ServerConfig
from mlx_relay.service import ChatService


def anthropic_routes(config: ServerConfig, service: Callable[[], ChatService],
                     check_model: Callable[[str | None], str]) -> list[Route]:
    return []

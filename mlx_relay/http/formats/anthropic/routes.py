"""Anthropic Messages' routes (`POST /v1/messages`, `/v1/messages/count_tokens`): the body
(`types`) into a neutral request (`request`), answered as Anthropic's event stream (`encoder`)
or one `message` (`collector`), every error in Anthropic's shape (`errors`), never OpenAI's.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_relay.config import ServerConfig
from mlx_relay.http.formats.anthropic.collector import collect_message
from mlx_relay.http.formats.anthropic.encoder import AnthropicStream
from mlx_relay.http.formats.anthropic.errors import anthropic_errors, decode
from mlx_relay.http.formats.anthropic.request import to_chat_request
from mlx_relay.http.formats.anthropic.types import CountTokensRequest, MessagesRequest, TokenCount
from mlx_relay.http.formats.route import FormatRoutes
from mlx_relay.http.served import Served

B = TypeVar("B")


class AnthropicRoutes(FormatRoutes):
    async def decode(self, request: Request, body_type: type[B]) -> B:
        return decode(await request.body(), body_type, self.config.limits.max_json_depth)

    async def messages(self, request: Request) -> Response:
        body = await self.decode(request, MessagesRequest)
        model = self.resolve(body.model)
        req = to_chat_request(body)
        message_id = f"msg_{uuid.uuid4().hex[:24]}"
        return await self.respond(request, [req], message_id, model=model, stream=body.stream,
                                  encoder=AnthropicStream(message_id, model),
                                  collect=lambda items: collect_message(items, message_id, model))

    async def count_tokens(self, request: Request) -> Response:
        body = await self.decode(request, CountTokensRequest)
        model = self.resolve(body.model)
        req = to_chat_request(body)
        async with self.served().use(model) as service:
            count = await service.count_tokens(req)
        return Response(msgspec.json.encode(TokenCount(count)), media_type="application/json")


def anthropic_routes(config: ServerConfig, served: Callable[[], Served]) -> list[Route]:
    routes = AnthropicRoutes(config, served)
    return [
        Route("/v1/messages", anthropic_errors(routes.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_errors(routes.count_tokens), methods=["POST"]),
    ]

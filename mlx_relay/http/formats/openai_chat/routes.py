"""OpenAI Chat Completions' routes (`POST /v1/chat/completions`, also without `/v1`): the body
(`types`) into n neutral requests (`request`), answered as a chunk stream (`encoder`) or one
`chat.completion` (`collector`) in OpenAI's error shape (`http/errors.py`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_relay.config import ServerConfig
from mlx_relay.http.formats.openai_chat.collector import collect_chat
from mlx_relay.http.formats.openai_chat.encoder import ChatStream
from mlx_relay.http.formats.openai_chat.request import to_chat_request
from mlx_relay.http.formats.openai_chat.types import ChatCompletionRequest
from mlx_relay.http.formats.route import FormatRoutes
from mlx_relay.http.replies import choice_requests
from mlx_relay.http.served import Served


class ChatRoutes(FormatRoutes):
    async def chat_completions(self, request: Request) -> Response:
        body = await self.decode(request, ChatCompletionRequest)
        model = self.resolve(body.model)
        reqs = choice_requests(to_chat_request(body), body.n)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await self.respond(request, reqs, rid, model=model, stream=body.stream,
                                  encoder=ChatStream(body.n, rid, model, include_usage, body.logprobs),
                                  collect=lambda items: collect_chat(items, body.n, rid, model, body.logprobs))


def openai_chat_routes(config: ServerConfig, served: Callable[[], Served]) -> list[Route]:
    routes = ChatRoutes(config, served)
    return [
        Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
        Route("/chat/completions", routes.chat_completions, methods=["POST"]),
    ]

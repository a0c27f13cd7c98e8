"""OpenAI legacy Completions' routes (`POST /v1/completions`, also without `/v1`): the body
(`types`) into a neutral request per prompt and choice (`request`), opened raw (no template, no
reply parsing), answered as a `text_completion` stream (`encoder`) or one body (`collector`) in
OpenAI's error shape (`http/errors.py`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_relay.config import ServerConfig
from mlx_relay.http.formats.openai_completions.collector import collect_completion
from mlx_relay.http.formats.openai_completions.encoder import CompletionStream
from mlx_relay.http.formats.openai_completions.request import to_requests
from mlx_relay.http.formats.openai_completions.types import CompletionRequest
from mlx_relay.http.formats.route import FormatRoutes
from mlx_relay.http.served import Served


class CompletionRoutes(FormatRoutes):
    async def completions(self, request: Request) -> Response:
        body = await self.decode(request, CompletionRequest)
        model = self.resolve(body.model)
        reqs = to_requests(body)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        return await self.respond(request, reqs, rid, model=model, stream=body.stream,
                                  encoder=CompletionStream(reqs, body.n, rid, model, body),
                                  collect=lambda items: collect_completion(items, reqs, body.n, rid, model, body),
                                  raw=True)


def completions_routes(config: ServerConfig, served: Callable[[], Served]) -> list[Route]:
    routes = CompletionRoutes(config, served)
    return [
        Route("/v1/completions", routes.completions, methods=["POST"]),
        Route("/completions", routes.completions, methods=["POST"]),
    ]

"""OpenAI Embeddings' route (`POST /v1/embeddings`, also without `/v1`): the body (`types`) into
inputs, the model named resolved to the served model whose engine holds that embedding model
(`Served.resolve_embedding`), held in use while its `EmbeddingService` embeds them, answered as
one body in OpenAI's error shape on failure (`http/errors.py`)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_relay.config import ServerConfig
from mlx_relay.errors import EmbeddingsUnavailable
from mlx_relay.http.formats.openai_embeddings.types import (
    EmbeddingRequest,
    answer,
    check_dimensions,
    inputs_of,
    truncated,
)
from mlx_relay.http.formats.route import FormatRoutes
from mlx_relay.http.served import Served


class EmbeddingRoutes(FormatRoutes):
    async def embeddings(self, request: Request) -> Response:
        body = await self.decode(request, EmbeddingRequest)
        served = self.served()
        owner = served.resolve_embedding(body.model)
        inputs = inputs_of(body)
        async with served.use(owner) as service:
            if service.embeddings is None:  # the model's engine came up without it
                raise EmbeddingsUnavailable(f"the model '{owner}' serves no embeddings", param="model")
            info = service.embeddings.info
            check_dimensions(body.dimensions, info.dims)
            result = await service.embeddings.embed(inputs)
        vectors = truncated(result.vectors, body.dimensions)
        out = answer(vectors, body, info.name, result.prompt_tokens)
        return Response(msgspec.json.encode(out), media_type="application/json")


def embeddings_routes(config: ServerConfig, served: Callable[[], Served]) -> list[Route]:
    routes = EmbeddingRoutes(config, served)
    return [
        Route("/v1/embeddings", routes.embeddings, methods=["POST"]),
        Route("/embeddings", routes.embeddings, methods=["POST"]),
    ]

"""OpenAI Responses API's routes (as Codex uses it), in OpenAI's error shape (`http/errors.py`):

    POST   /v1/responses        the body (`types`) -> ChatRequest (`request`, `tools`) -> reply
                                events -> response events (`encoder`) or one response (`collector`)
    GET    /v1/responses/{id}   a stored response
    DELETE /v1/responses/{id}

`previous_response_id` prepends a stored conversation (that request's input without its
instructions, as OpenAI does, then that response's output) from a bounded in-memory
`ResponseStore` (`store`) owned by the routes; a response is stored before the client hears
it finished.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_relay.chat.types import ChatMessage
from mlx_relay.config import ServerConfig
from mlx_relay.http.formats.responses.collector import collect_response
from mlx_relay.http.formats.responses.encoder import ResponseAssembler, ResponsesStream
from mlx_relay.http.formats.responses.request import items_to_messages, output_messages, parse_items, translate
from mlx_relay.http.formats.responses.store import (
    PreviousResponseNotFound,
    ResponseNotFound,
    ResponseStore,
    StoredResponse,
)
from mlx_relay.http.formats.responses.tools import ToolNames, parse_tools
from mlx_relay.http.formats.responses.types import DeletedResponse, ResponseObject, ResponsesRequest
from mlx_relay.http.formats.route import FormatRoutes
from mlx_relay.http.served import Served


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


class ResponsesRoutes(FormatRoutes):
    def __init__(self, config: ServerConfig, served: Callable[[], Served],
                 store: ResponseStore[StoredResponse] | None = None) -> None:
        super().__init__(config, served)
        self.store: ResponseStore[StoredResponse] = store if store is not None else ResponseStore()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/responses/{response_id}", self.delete, methods=["DELETE"]),
        ]

    async def retrieve(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            raise ResponseNotFound(f"no stored response with id '{rid}'", param="response_id")
        return _json(stored.response)

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        if not self.store.delete(rid):
            raise ResponseNotFound(f"no stored response with id '{rid}'", param="response_id")
        return _json(DeletedResponse(rid))

    async def create(self, request: Request) -> Response:
        body = await self.decode(request, ResponsesRequest)
        model = self.resolve(body.model)
        tools, names = parse_tools(body.tools)
        conversation = self._prior(body.previous_response_id) + items_to_messages(parse_items(body.input), names)
        req, response = translate(body, model, conversation, tools, names)
        assembler = ResponseAssembler(response, names)

        def finished() -> None:
            if response.store:
                self._remember(response, conversation, names)

        return await self.respond(request, [req], response.id, model=model, stream=body.stream,
                                  encoder=ResponsesStream(assembler, finished),
                                  collect=lambda items: collect_response(items, assembler, finished))

    def _prior(self, previous_id: str | None) -> list[ChatMessage]:
        if previous_id is None:
            return []
        stored = self.store.get(previous_id)
        if stored is None:
            raise PreviousResponseNotFound(
                f"previous response with id '{previous_id}' not found (never stored, store=false, evicted or "
                "deleted); send the whole conversation as input instead", param="previous_response_id")
        return list(stored.messages)

    def _remember(self, response: ResponseObject, conversation: list[ChatMessage], names: ToolNames) -> None:
        entry = StoredResponse(response, conversation + output_messages(response.output, names))
        self.store.put(response.id, entry, len(msgspec.json.encode(entry)))


def responses_routes(config: ServerConfig, served: Callable[[], Served]) -> list[Route]:
    return ResponsesRoutes(config, served).routes()

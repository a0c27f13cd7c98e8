"""The OpenAPI 3.1 document of the HTTP front end (`GET /openapi.json`), generated from the same
msgspec types the routes decode and encode, so it cannot drift from them; schema fuzzers
(schemathesis, tests/test_reliability_fuzz.py) run from it.

`ROUTES` names, for every route the app serves, its request body type, its answer and the error
shape it uses (OpenAI's `{"error": {...}}`, or Anthropic's `{"type": "error", ...}` on
`/v1/messages*`); `routes_not_described` lets a test fail when a route is added without one.
Like every route but `/health`, the document is behind the API key when the server has one.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from starlette.routing import BaseRoute, Route

from mlx_relay.http.errors import ErrorBody
from mlx_relay.http.formats.anthropic.errors import ErrorBody as AnthropicError
from mlx_relay.http.formats.anthropic.types import CountTokensRequest, Message, MessagesRequest, TokenCount
from mlx_relay.http.formats.openai_chat.types import ChatCompletion, ChatCompletionRequest
from mlx_relay.http.formats.openai_completions.types import Completion, CompletionRequest
from mlx_relay.http.formats.openai_embeddings.types import EmbeddingList, EmbeddingRequest
from mlx_relay.http.formats.responses.types import DeletedResponse, ResponseObject, ResponsesRequest
from mlx_relay.http.loads import WorkerLoads
from mlx_relay.http.types import FlushBody, HealthBody, LoadModelBody, ModelCard, ModelList, PooledModelCard

Shape = Literal["openai", "anthropic"]


class Operation(msgspec.Struct, frozen=True):
    summary: str
    answer: type | None  # the 200 body's type (None: a free-form JSON object)
    body: type | None = None  # the request body's type
    streams: bool = False  # `"stream": true` answers text/event-stream
    shape: Shape = "openai"
    path_param: str | None = None
    open: bool = False  # answered without an API key
    text: bool = False  # the 200 is text/plain (the Prometheus exposition), not JSON


def _chat_ops(summary: str, body: type, answer: type) -> Operation:
    return Operation(summary, answer, body, streams=True)


ROUTES: dict[tuple[str, str], Operation] = {
    ("/health", "GET"): Operation("Readiness: 200 only when ready; 503 (loading, warming, degraded, draining, "
                                  "failed) otherwise", HealthBody, open=True),
    ("/openapi.json", "GET"): Operation("This document", None),
    ("/metrics", "GET"): Operation("Prometheus metrics (text exposition format 0.0.4)", None, text=True),
    ("/v1/loads", "GET"): Operation("Load for a router in front (SMG's WorkerLoadResponse: running, waiting, "
                                    "slots)", WorkerLoads),
    ("/v1/models", "GET"): Operation("The served models (a pool's: every configured model with its state, "
                                     "memory, pinned, last use)", ModelList),
    ("/v1/models/{model}", "GET"): Operation("One model", ModelCard, path_param="model"),
    ("/v1/models/{model}/load", "POST"): Operation("Load a model of the pool now (a body with a `path`: one the "
                                                   "server was not started with); 400 on a server of one model",
                                                   PooledModelCard, LoadModelBody, path_param="model"),
    ("/v1/models/{model}/unload", "POST"): Operation("Unload a model of the pool (its streams finish within the "
                                                     "drain timeout)", PooledModelCard, path_param="model"),
    ("/v1/chat/completions", "POST"): _chat_ops("Chat completions (OpenAI)", ChatCompletionRequest, ChatCompletion),
    ("/chat/completions", "POST"): _chat_ops("Chat completions (OpenAI)", ChatCompletionRequest, ChatCompletion),
    ("/v1/completions", "POST"): _chat_ops("Text completions (OpenAI)", CompletionRequest, Completion),
    ("/completions", "POST"): _chat_ops("Text completions (OpenAI)", CompletionRequest, Completion),
    ("/v1/embeddings", "POST"): Operation("Embeddings (OpenAI), by the embedding model beside a chat model "
                                          "(--embedding-model)", EmbeddingList, EmbeddingRequest),
    ("/embeddings", "POST"): Operation("Embeddings (OpenAI)", EmbeddingList, EmbeddingRequest),
    ("/v1/messages", "POST"): Operation("Messages (Anthropic)", Message, MessagesRequest, streams=True,
                                        shape="anthropic"),
    ("/v1/messages/count_tokens", "POST"): Operation("Count a prompt's tokens (Anthropic)", TokenCount,
                                                     CountTokensRequest, shape="anthropic"),
    ("/v1/responses", "POST"): _chat_ops("Responses (OpenAI)", ResponsesRequest, ResponseObject),
    ("/responses", "POST"): _chat_ops("Responses (OpenAI)", ResponsesRequest, ResponseObject),
    ("/v1/responses/{response_id}", "GET"): Operation("A stored response", ResponseObject, path_param="response_id"),
    ("/v1/responses/{response_id}", "DELETE"): Operation("Delete a stored response", DeletedResponse,
                                                         path_param="response_id"),
    ("/responses/{response_id}", "GET"): Operation("A stored response", ResponseObject, path_param="response_id"),
    ("/responses/{response_id}", "DELETE"): Operation("Delete a stored response", DeletedResponse,
                                                      path_param="response_id"),
    ("/v1/cache/stats", "GET"): Operation("Prefix and vision cache counters", None),
    ("/v1/cache/flush", "POST"): Operation("Drop every unused prefix-cache snapshot", FlushBody),
    ("/v1/specprefill/stats", "GET"): Operation("SpecPrefill counters", None),
}

_ERRORS: dict[Shape, dict[int, str]] = {
    "openai": {400: "Invalid request (malformed JSON, invalid UTF-8, too deep, a value out of range)",
               401: "Missing or invalid API key", 404: "No such model, route or stored response",
               408: "The request was not sent in time", 413: "The request body is too large",
               422: "The body does not fit the schema", 429: "Overloaded: retry after Retry-After",
               500: "Internal error (the message names an incident id)", 503: "Not ready, draining or shutting down"},
    "anthropic": {400: "Invalid request", 401: "Missing or invalid API key", 404: "Not found",
                  408: "The request was not sent in time", 413: "The request body is too large",
                  429: "Rate limited: retry after Retry-After", 500: "Internal error",
                  503: "Overloaded: retry after Retry-After"},
}


# one server-sent event of a streamed answer, as SSE clients (and schemathesis) read the stream:
# `data` is the JSON of the format's chunk or event (`[DONE]` ends OpenAI's streams)
SSE_EVENT: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def _spec_path(route: Route) -> str:
    """Starlette's `{model:path}` converter spelled as OpenAPI's `{model}`."""
    return route.path.replace(":path}", "}")


def routes_not_described(routes: list[BaseRoute]) -> list[tuple[str, str]]:
    """The app's (path, method) pairs that have no entry in ROUTES (HEAD aside)."""
    missing = []
    for route in routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD" and (_spec_path(route), method) not in ROUTES:
                    missing.append((route.path, method))
    return missing


def build_openapi(title: str, version: str, with_auth: bool) -> dict[str, Any]:
    body_types = {op.body for op in ROUTES.values() if op.body is not None}
    answer_types = {op.answer for op in ROUTES.values() if op.answer is not None}
    types = sorted(body_types | answer_types | {ErrorBody, AnthropicError}, key=lambda t: t.__name__)
    # names shared by two types (the two ErrorBody) come out qualified by their modules
    refs, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    ref = dict(zip(types, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for (path, method), op in ROUTES.items():
        error_ref = ref[AnthropicError] if op.shape == "anthropic" else ref[ErrorBody]
        ok: dict[str, Any] = {"application/json": {"schema": ref[op.answer] if op.answer else {"type": "object"}}}
        if op.text:
            ok = {"text/plain": {"schema": {"type": "string"}}}
        if op.streams:
            ok["text/event-stream"] = {"schema": SSE_EVENT}
        responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
        for status, text in _ERRORS[op.shape].items():
            if method == "GET" and status in (408, 413, 422):
                continue
            if op.open and status == 401:
                continue
            responses[str(status)] = {"description": text, "content": {"application/json": {"schema": error_ref}}}
        if path == "/health":
            not_ready = {"application/json": {"schema": ref[HealthBody]}}
            responses["503"] = {"description": "Not ready", "content": not_ready}
        operation: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(path, method),
                                     "responses": responses}
        if op.body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref[op.body]}}}
        if op.path_param is not None:
            operation["parameters"] = [{"name": op.path_param, "in": "path", "required": True,
                                        "schema": {"type": "string", "minLength": 1}}]
        if with_auth and not op.open:
            operation["security"] = [{"bearer": []}, {"apiKey": []}]
        paths.setdefault(path, {})[method.lower()] = operation
    doc: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                           "components": {"schemas": components}}
    if with_auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return doc


def _operation_id(path: str, method: str) -> str:
    words = [w.strip("{}") for w in path.split("/") if w]
    return method.lower() + "_" + "_".join(words).replace(".", "_")

"""The Starlette app: its assembly (the routes of every wire format, `http/formats/`, beside the
server's own: health, metrics, models, the prefix cache, loads; the middleware; the lifespan
that boots the relay) and the server's own routes. The formats translate HTTP into actor
messages (through `ChatService`) and back.

Everything that can refuse a request (validation, auth, admission, template, context length)
happens before the response starts, so a refused request is a clean 4xx/429/503, never a 200
followed by an error frame. A streamed response owns its generation: when the client goes away,
Starlette cancels the response's task group and the generation and its slot are released.
"""

from __future__ import annotations

import functools
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_relay.config import ServerConfig
from mlx_relay.errors import ModelNotFound, NotFound, NotReady, RelayError, Unauthorized
from mlx_relay.http.body import decode_body
from mlx_relay.http.errors import as_relay_error, error_response
from mlx_relay.http.formats.anthropic.errors import error_response as anthropic_error_response
from mlx_relay.http.formats.anthropic.errors import is_anthropic_path
from mlx_relay.http.formats.anthropic.routes import anthropic_routes
from mlx_relay.http.formats.openai_chat.routes import openai_chat_routes
from mlx_relay.http.formats.openai_completions.routes import completions_routes
from mlx_relay.http.formats.openai_embeddings.routes import embeddings_routes
from mlx_relay.http.formats.responses.routes import responses_routes
from mlx_relay.http.guard import RequestGuard
from mlx_relay.http.lifecycle import Lifecycle
from mlx_relay.http.loads import parse_include, worker_loads
from mlx_relay.http.openapi import build_openapi
from mlx_relay.http.request_log import RequestLog
from mlx_relay.http.served import BootServed, Served
from mlx_relay.http.types import FlushBody, LoadModelBody, ModelList
from mlx_relay.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

if TYPE_CHECKING:
    from mlx_relay.relay import Relay


JSON = "application/json"


def _json(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type=JSON)


class AuthMiddleware:
    """API keys as `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time.
    `/health` stays open."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"")
        offered = [headers.get(b"x-api-key", b""), auth[7:].strip() if auth[:7].lower() == b"bearer " else b""]
        ok = False
        for given in offered:  # every comparison runs: the time does not depend on which matched
            for key in self.keys:
                ok |= hmac.compare_digest(given, key)
        if ok:
            await self.app(scope, receive, send)
            return
        await _respond_error(scope["path"], Unauthorized("missing or invalid API key"))(scope, receive, send)


class ServerRoutes:
    """The server's own routes (no wire format) over what the app serves (`Served`: one model or
    a pool, set by the lifespan once booted), which every format's routes get too (`served`)."""

    def __init__(self, config: ServerConfig, served: Served | None) -> None:
        self.config = config
        self._served = served
        self.created = int(time.time())
        doc = build_openapi("mlx-relay", _own_version(), with_auth=bool(config.api_keys))
        self._openapi = Response(msgspec.json.encode(doc), media_type=JSON)

    def served(self) -> Served:
        if self._served is None:
            raise NotReady("the server is starting")
        return self._served

    async def health(self, request: Request) -> Response:
        """200 only when ready; 503 + Retry-After while loading, warming, degraded (an actor is
        restarting), draining or failed, with what is down. The running and queued counts (and
        the limits they run against) come in every state Admission answers in; a pool adds each
        model's state."""
        body, ready = await self.served().health()
        if ready:
            return _json(body)
        response = _json(body, 503)
        response.headers["Retry-After"] = "5"
        return response

    async def openapi(self, request: Request) -> Response:
        return self._openapi

    async def loads(self, request: Request) -> Response:
        """What a router polls for load (`http/loads.py`): Admission's counters in SMG's schema."""
        parse_include(request.query_params.get("include"))
        return _json(worker_loads(await self.served().admission_stats()))

    async def metrics(self, request: Request) -> Response:
        return Response(await self.served().scrape(), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        return _json(ModelList(await self.served().model_cards(self.created)))

    async def model(self, request: Request) -> Response:
        served, wanted = self.served(), request.path_params["model"]
        cards = await served.model_cards(self.created)
        try:
            name = served.resolve(wanted)
        except ModelNotFound:  # an embedding model beside a served one is no model of its own: its card
            if (card := next((c for c in cards if c.id == wanted), None)) is None:
                raise
            return _json(card)
        return _json(next(card for card in cards if card.id == name))

    async def load_model(self, request: Request) -> Response:
        """`POST /v1/models/{name}/load` (a pool's): load it now; with a body naming a `path`, a
        model the server was not started with. 200 with its card once loaded."""
        raw = await request.body()
        body = decode_body(raw, LoadModelBody, self.config.limits.max_json_depth) if raw.strip() else LoadModelBody()
        return _json(await self.served().load(request.path_params["model"], body))

    async def unload_model(self, request: Request) -> Response:
        """`POST /v1/models/{name}/unload` (a pool's): stop admitting to it, let its streams finish
        (within the drain timeout), free its memory. 200 with its card once unloaded."""
        return _json(await self.served().unload(request.path_params["model"]))

    def _relay(self, request: Request) -> Relay:
        """The loaded model a cache route names (`?model=`; none: the default model)."""
        served = self.served()
        name = request.query_params.get("model")
        relay = served.relay(None if name is None else served.resolve(name))
        if relay.service is None or relay.state != "ready":
            raise NotReady(f"the model is {relay.state}")
        return relay

    async def cache_stats(self, request: Request) -> Response:
        return _json(await self._relay(request).prefix_cache_stats())

    async def specprefill_stats(self, request: Request) -> Response:
        return _json(await self._relay(request).specprefill_stats())

    async def cache_flush(self, request: Request) -> Response:
        flushed = await self._relay(request).flush_prefix_cache()
        return _json(FlushBody(flushed.entries, flushed.bytes))


def _own_version() -> str:
    try:
        return version("mlx-relay")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+source"


def _respond_error(path: str, err: RelayError) -> Response:
    """An error in the route's own shape: Anthropic's on /v1/messages*, else OpenAI's."""
    return anthropic_error_response(err) if is_anthropic_path(path) else error_response(err)


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no route) and 405 (wrong method), in the route's error shape."""
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            err: RelayError = NotFound(f"no route {request.method} {request.url.path}")
        else:
            err = RelayError(exc.detail or "error")
            err.status = exc.status_code
            err.type = "invalid_request_error"
        response = _respond_error(request.url.path, err)
        if exc.headers:
            response.headers.update(exc.headers)  # e.g. Allow on a 405
        return response
    return error_response(exc)


async def _any_exception(request: Request, exc: Exception) -> Response:
    return _respond_error(request.url.path, as_relay_error(exc))


def create_app(
    config: ServerConfig,
    served: Served | None = None,
    *,
    lifecycle: Lifecycle | None = None,
    boot: BootServed | None = None,
) -> Starlette:
    """The app. Without `served`, the app's lifespan boots it with `boot` (one model's relay,
    `served.one_model(Relay.start)`, or a pool; in the background, so `/health` answers 503
    loading/warming until it is ready), runs the `lifecycle` beside it (ready, failure, drain)
    and shuts it down with the server."""
    routes = ServerRoutes(config, served)
    lifespan = None
    if served is None and boot is not None:
        life = lifecycle or Lifecycle()
        start = boot

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with start(config=config, wait_ready=False, on_progress=life.on_progress) as booted:
                routes._served = booted
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(life.run, booted, config.drain_timeout_s,
                                                    drain_on_stdin_eof=config.exit_on_stdin_eof))
                    yield
                    tg.cancel_scope.cancel()

    app = Starlette(
        routes=[
            Route("/health", routes.health, methods=["GET"]),
            Route("/openapi.json", routes.openapi, methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/v1/loads", routes.loads, methods=["GET"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/models/{model:path}/load", routes.load_model, methods=["POST"]),
            Route("/v1/models/{model:path}/unload", routes.unload_model, methods=["POST"]),
            Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
            Route("/v1/cache/stats", routes.cache_stats, methods=["GET"]),
            Route("/v1/cache/flush", routes.cache_flush, methods=["POST"]),
            Route("/v1/specprefill/stats", routes.specprefill_stats, methods=["GET"]),
            *openai_chat_routes(config, routes.served),
            *completions_routes(config, routes.served),
            *embeddings_routes(config, routes.served),
            *anthropic_routes(config, routes.served),
            *responses_routes(config, routes.served),
        ],
        exception_handlers={HTTPException: _http_exception, RelayError: _any_exception, Exception: _any_exception},
        lifespan=lifespan,
    )
    app.add_middleware(AuthMiddleware, keys=config.api_keys)
    app.add_middleware(RequestGuard, limits=config.limits, respond=_respond_error)
    app.add_middleware(RequestLog, log_prompts=config.log_prompts, respond=_respond_error)  # outermost
    return app

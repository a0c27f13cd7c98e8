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
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Protocol

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_relay.config import ServerConfig
from mlx_relay.errors import ModelLoadError, ModelNotFound, NotFound, NotReady, RelayError, Unauthorized
from mlx_relay.http.errors import as_relay_error, error_response
from mlx_relay.http.formats.anthropic.errors import error_response as anthropic_error_response
from mlx_relay.http.formats.anthropic.errors import is_anthropic_path
from mlx_relay.http.formats.anthropic.routes import anthropic_routes
from mlx_relay.http.formats.openai_chat.routes import openai_chat_routes
from mlx_relay.http.formats.openai_completions.routes import completions_routes
from mlx_relay.http.formats.responses.routes import responses_routes
from mlx_relay.http.guard import RequestGuard
from mlx_relay.http.lifecycle import Lifecycle
from mlx_relay.http.loads import parse_include, worker_loads
from mlx_relay.http.openapi import build_openapi
from mlx_relay.http.request_log import RequestLog
from mlx_relay.http.types import FlushBody, HealthBody, ModelCapabilities, ModelCard, ModelList
from mlx_relay.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mlx_relay.runtime import RuntimeFault
from mlx_relay.service import ChatService

if TYPE_CHECKING:
    from mlx_relay.relay import Relay


class BootRelay(Protocol):
    """Starts a relay for the app's lifespan (`Relay.start`, passed in by the composition root:
    the HTTP layer itself never imports the engine)."""

    def __call__(self, *, config: ServerConfig, wait_ready: bool,
                 on_progress: Callable[[str], None] | None) -> AbstractAsyncContextManager[Relay]: ...

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
    """The server's own routes (no wire format), and what every format's routes get from the app:
    the chat service once the relay is ready (`_service`) and the model check (`_check_model`)."""

    def __init__(self, config: ServerConfig, relay: Relay | None) -> None:
        self.config = config
        self._relay = relay
        self.created = int(time.time())
        doc = build_openapi("mlx-relay", _own_version(), with_auth=bool(config.api_keys))
        self._openapi = Response(msgspec.json.encode(doc), media_type=JSON)

    @property
    def relay(self) -> Relay:
        if self._relay is None:
            raise NotReady("the server is starting")
        return self._relay

    def _service(self) -> ChatService:
        if self.relay.service is None or self.relay.state not in ("ready",):
            raise NotReady(f"the server is {self.relay.state}")
        return self.relay.service

    def _check_model(self, model: str | None) -> str:
        served = self.config.served_model_name
        aliases = self.config.model_aliases
        if model is None or model in (served, self.config.model) or model in aliases or "*" in aliases:
            return served
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves '{served}'", model=model,
                            param="model")

    async def health(self, request: Request) -> Response:
        """200 only when ready; 503 + Retry-After while loading, warming, degraded (an actor is
        restarting), draining or failed, with what is down. The running and queued counts (and
        the limits they run against) come in every state Admission answers in."""
        relay = self.relay
        health = relay.health()
        body = HealthBody(health.status, relay.config.served_model_name,  # type: ignore[arg-type]
                          backend=relay.info.backend if relay.info is not None else None,
                          down=health.down or None)
        if relay.error is not None:  # the operator's view: what failed, never a traceback
            body.error = str(relay.error) if isinstance(relay.error, ModelLoadError) else type(relay.error).__name__
        try:
            stats = await relay.stats()
        except RuntimeFault:  # Admission itself is restarting or stopped: no counts to give
            pass
        else:
            body.running, body.queued = stats.running, stats.queued
            body.max_num_seqs, body.max_queue = stats.max_num_seqs, stats.max_queue
        if health.ready:
            return _json(body)
        response = _json(body, 503)
        response.headers["Retry-After"] = "5"
        return response

    async def openapi(self, request: Request) -> Response:
        return self._openapi

    async def loads(self, request: Request) -> Response:
        """What a router polls for load (`http/loads.py`): Admission's counters in SMG's schema."""
        parse_include(request.query_params.get("include"))
        try:
            stats = await self.relay.stats()
        except RuntimeFault:  # Admission itself is restarting or stopped
            raise NotReady("the server's admission is restarting") from None
        return _json(worker_loads(stats))

    async def metrics(self, request: Request) -> Response:
        return Response(await self.relay.scrape(), media_type=METRICS_CONTENT_TYPE)

    def _model_card(self) -> ModelCard:
        info, features = self.relay.info, self.relay.prompt_features
        ctx = info.context_length if info is not None else None
        caps = None
        if info is not None and features is not None:
            caps = ModelCapabilities(vision=info.has_vision, tools=features.tool_format is not None,
                                     reasoning=features.reasoning)
        return ModelCard(self.config.served_model_name, self.created, context_length=ctx, max_model_len=ctx,
                         capabilities=caps)

    async def models(self, request: Request) -> Response:
        return _json(ModelList([self._model_card()]))

    async def model(self, request: Request) -> Response:
        self._check_model(request.path_params["model"])
        return _json(self._model_card())

    async def cache_stats(self, request: Request) -> Response:
        self._service()
        return _json(await self.relay.prefix_cache_stats())

    async def specprefill_stats(self, request: Request) -> Response:
        self._service()
        return _json(await self.relay.specprefill_stats())

    async def cache_flush(self, request: Request) -> Response:
        self._service()
        flushed = await self.relay.flush_prefix_cache()
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
    relay: Relay | None = None,
    *,
    lifecycle: Lifecycle | None = None,
    boot: BootRelay | None = None,
) -> Starlette:
    """The app. Without a `relay`, the app's lifespan boots one with `boot` (in the background,
    so `/health` answers 503 loading/warming until it is ready), runs the `lifecycle` beside it
    (ready, failure, drain) and shuts it down with the server."""
    routes = ServerRoutes(config, relay)
    lifespan = None
    if relay is None and boot is not None:
        life = lifecycle or Lifecycle()
        start = boot

        @asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[None]:
            async with start(config=config, wait_ready=False, on_progress=life.on_progress) as booted:
                routes._relay = booted
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
            Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
            Route("/v1/cache/stats", routes.cache_stats, methods=["GET"]),
            Route("/v1/cache/flush", routes.cache_flush, methods=["POST"]),
            Route("/v1/specprefill/stats", routes.specprefill_stats, methods=["GET"]),
            *openai_chat_routes(config, routes._service, routes._check_model),
            *completions_routes(config, routes._service, routes._check_model),
            *anthropic_routes(config, routes._service, routes._check_model),
            *responses_routes(config, routes._service, routes._check_model),
        ],
        exception_handlers={HTTPException: _http_exception, RelayError: _any_exception, Exception: _any_exception},
        lifespan=lifespan,
    )
    app.add_middleware(AuthMiddleware, keys=config.api_keys)
    app.add_middleware(RequestGuard, limits=config.limits, respond=_respond_error)
    app.add_middleware(RequestLog, log_prompts=config.log_prompts, respond=_respond_error)  # outermost
    return app

"""What the HTTP app serves, behind one protocol (`Served`): one model's Relay (`OneModel`, what
`mlx-relay serve [MODEL]` runs) or a pool of models loaded on demand (`pool.pool.ModelPool`,
`--model NAME=PATH` / `--models-config`). The routes ask it which model a request names
(`resolve`), hold that model in use for the request's whole life (`use`: the chat service, once
loaded), and read health, model cards, loads and metrics from it; the lifecycle waits on it and
drains it. Nothing here imports the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import anyio

from mlx_relay.config import ServerConfig
from mlx_relay.errors import EmbeddingsUnavailable, InvalidRequest, ModelLoadError, ModelNotFound, NotReady
from mlx_relay.http.types import HealthBody, LoadModelBody, ModelCapabilities, ModelCard
from mlx_relay.messages.admission import AdmissionStats
from mlx_relay.runtime import RuntimeFault
from mlx_relay.service import ChatService

if TYPE_CHECKING:
    from mlx_relay.relay import DrainReport, Relay


class Served(Protocol):
    """The app's view of what it serves (`OneModel` or `ModelPool`)."""

    ready: anyio.Event  # set once ready to serve, or failed
    failed: anyio.Event  # set when it cannot serve any more (the process exits non-zero)
    error: BaseException | None

    def resolve(self, model: str | None) -> str:
        """A request's `model` -> the served name, or `ModelNotFound` (404) naming what is served."""
        ...

    def resolve_embedding(self, model: str | None) -> str:
        """A `/v1/embeddings` request's `model` -> the served model whose engine holds that embedding
        model (`--embedding-model`); `EmbeddingsUnavailable` (400) for a chat model without one,
        `ModelNotFound` (404) for any other name."""
        ...

    def use(self, name: str) -> AbstractAsyncContextManager[ChatService]:
        """The model's chat service, held in use until the context is left (the request's whole
        response): a pool loads the model first (or answers 503 + Retry-After) and never unloads
        it for room while it is in use."""
        ...

    def relay(self, name: str | None) -> Relay:
        """A loaded model's Relay (None: the default model's); `NotReady` when it is not loaded."""
        ...

    async def health(self) -> tuple[HealthBody, bool]:
        """`/health`'s body, and whether it is ready (200) or not (503)."""
        ...

    async def model_cards(self, created: int) -> list[ModelCard]: ...

    async def admission_stats(self) -> AdmissionStats:
        """Every loaded model's admission counts together (`/v1/loads`)."""
        ...

    async def scrape(self) -> bytes: ...

    async def load(self, name: str, body: LoadModelBody) -> ModelCard:
        """`POST /v1/models/{name}/load`: load it now (or register and load a new one)."""
        ...

    async def unload(self, name: str) -> ModelCard:
        """`POST /v1/models/{name}/unload`: drain it and free its memory."""
        ...

    async def drain(self, timeout_s: float) -> DrainReport: ...

    def ready_line(self) -> str:
        """What `mlx-relay serve` prints once ready."""
        ...


def embedding_owner(model: str | None, configs: list[ServerConfig], resolve: Callable[[str | None], str]) -> str:
    """`Served.resolve_embedding` over the served models' configs (`resolve`: a chat model's name)."""
    for config in configs:
        if model is not None and model in config.engine.embedding_names:
            return config.served_model_name
    names = [n for config in configs for n in config.engine.embedding_names[:1]]
    chat = resolve(model)  # ModelNotFound for a name nothing serves
    raise EmbeddingsUnavailable(f"the model '{chat}' is a chat model and serves no embeddings; "
                                + (f"embedding models here: {', '.join(names)}" if names else
                                   "this server has no embedding model (--embedding-model)"), param="model")


class BootServed(Protocol):
    """Starts what the app serves for its lifespan (the composition root passes it in: the HTTP
    layer never imports the engine)."""

    def __call__(self, *, config: ServerConfig, wait_ready: bool,
                 on_progress: Callable[[str], None] | None) -> AbstractAsyncContextManager[Served]: ...


class BootRelay(Protocol):
    """`Relay.start`'s shape, as `one_model` takes it."""

    def __call__(self, *, config: ServerConfig, wait_ready: bool,
                 on_progress: Callable[[str], None] | None) -> AbstractAsyncContextManager[Relay]: ...


def one_model(start: BootRelay) -> BootServed:
    """The app's boot for one model: `start` (`Relay.start`) wrapped as `OneModel`."""

    @asynccontextmanager
    async def boot(*, config: ServerConfig, wait_ready: bool,
                   on_progress: Callable[[str], None] | None) -> AsyncIterator[Served]:
        async with start(config=config, wait_ready=wait_ready, on_progress=on_progress) as relay:
            yield OneModel(relay)

    return boot


class OneModel:
    """One model's Relay as the app serves it: the name, its path and its aliases resolve to it."""

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self.config = relay.config
        self.ready, self.failed = relay.ready, relay.failed

    @property
    def error(self) -> BaseException | None:
        return self._relay.error

    def resolve_embedding(self, model: str | None) -> str:
        return embedding_owner(model, [self.config], self.resolve)

    def resolve(self, model: str | None) -> str:
        served, aliases = self.config.served_model_name, self.config.model_aliases
        if model is None or model in (served, self.config.model) or model in aliases or "*" in aliases:
            return served
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves '{served}'", model=model,
                            param="model")

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ChatService]:
        relay = self._relay
        if relay.service is None or relay.state != "ready":
            raise NotReady(f"the server is {relay.state}")
        yield relay.service

    def relay(self, name: str | None) -> Relay:
        return self._relay

    async def health(self) -> tuple[HealthBody, bool]:
        relay = self._relay
        health = relay.health()
        body = HealthBody(health.status, self.config.served_model_name,  # type: ignore[arg-type]
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
        return body, health.ready

    async def model_cards(self, created: int) -> list[ModelCard]:
        return [model_card(self._relay, created), *embedding_card(self.config, self._relay, created)]

    async def admission_stats(self) -> AdmissionStats:
        try:
            return await self._relay.stats()
        except RuntimeFault:  # Admission itself is restarting or stopped
            raise NotReady("the server's admission is restarting") from None

    async def scrape(self) -> bytes:
        return await self._relay.scrape()

    async def load(self, name: str, body: LoadModelBody) -> ModelCard:
        raise _serves_one_model()

    async def unload(self, name: str) -> ModelCard:
        raise _serves_one_model()

    async def drain(self, timeout_s: float) -> DrainReport:
        return await self._relay.drain(timeout_s)

    def ready_line(self) -> str:
        info = self._relay.info
        assert info is not None
        return (f"model {self.config.served_model_name} ({info.model_type}, {info.backend.upper()} backend, "
                f"context {info.context_length})")


def _serves_one_model() -> InvalidRequest:
    return InvalidRequest("this server serves one model; start it with --model NAME=PATH (or --models-config) "
                          "to load and unload models")


def embedding_card(config: ServerConfig, relay: Relay | None, created: int) -> list[ModelCard]:
    """The card of the embedding model beside `config`'s model (none without one): its name, and once
    its engine has loaded it its context (capabilities: embeddings only)."""
    if not config.engine.embedding_names:
        return []
    info = relay.info.embedding if relay is not None and relay.info is not None else None
    ctx = info.context_length if info is not None else None
    caps = ModelCapabilities(vision=False, tools=False, reasoning=False, embeddings=True) if info else None
    return [ModelCard(config.engine.embedding_names[0], created, context_length=ctx, max_model_len=ctx,
                      capabilities=caps)]


def model_card(relay: Relay, created: int) -> ModelCard:
    """A loaded (or loading) relay's card: its context and capabilities once known."""
    info, features = relay.info, relay.prompt_features
    ctx = info.context_length if info is not None else None
    caps = None
    if info is not None and features is not None:
        caps = ModelCapabilities(vision=info.has_vision, tools=features.tool_format is not None,
                                 reasoning=features.reasoning)
    return ModelCard(relay.config.served_model_name, created, context_length=ctx, max_model_len=ctx,
                     capabilities=caps)

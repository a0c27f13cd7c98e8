"""Relay: the assembled server core, usable in-process or behind HTTP.

    async with Relay.start(model="path/or/repo") as relay:
        reply = await relay.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        async for delta in relay.stream_chat([...]):
            print(delta, end="")

`start` spawns the actors (Admission first, so the server can answer 503 while the model
loads; then the GPUExecutor, which loads the model on its thread; the Normalizer), warms the
kernels and marks the server ready. `wait_ready=False` returns at once and boots in the
background (what the HTTP server does, so `/health` reports loading/warming).

`health()` tells the truth about the actors: crashed ones restart on their own (the server is
"degraded" meanwhile); if one cannot be restarted the relay is "failed" and `failed` is set (the
HTTP server then exits non-zero). `drain()` is the graceful stop: no new requests, the running
ones finish within a deadline, the rest are ended with a retryable error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec

from mlx_relay.actors.admission import Admission, AdmissionStats, GetStats, SetState, WhenIdle
from mlx_relay.actors.gpu_executor import AbortAll, AttachPrefixStore, GPUExecutor
from mlx_relay.actors.media_router import MediaRouter
from mlx_relay.actors.normalizer import Normalizer
from mlx_relay.actors.prefix_cache_store import (
    Flush,
    Flushed,
    GetPrefixStats,
    PrefixCacheConfig,
    PrefixCacheStore,
    PrefixStats,
)
from mlx_relay.actors.specprefill_scorer import GetSpecPrefillStats, SpecPrefillScorer
from mlx_relay.chat.types import ChatMessage
from mlx_relay.config import (
    AdmissionConfig,
    EngineConfig,
    MediaConfig,
    PromptConfig,
    RequestLimits,
    ServerConfig,
    SpecPrefillConfig,
)
from mlx_relay.engine.loader import resolve_model_path
from mlx_relay.engine.messages import (
    Describe,
    EngineStats,
    Finished,
    GetEngineStats,
    ModelInfo,
    SpecPrefillReport,
    TokenDelta,
    Warmup,
)
from mlx_relay.errors import NotReady, UnprocessableRequest
from mlx_relay.runtime import ActorRef, ActorSystem
from mlx_relay.service import ChatRequest, ChatService, SamplingDefaults

log = logging.getLogger(__name__)


class SystemFailure(Exception):
    """An actor could not be restarted: the relay cannot serve any more."""


class Health(msgspec.Struct, frozen=True):
    status: str
    down: dict[str, str]  # actors not running now: name -> restarting / failed
    ready: bool


class DrainReport(msgspec.Struct, frozen=True):
    seconds: float
    ended: int  # generations ended by the deadline (their streams got a retryable error)


class ChatResult(msgspec.Struct, frozen=True):
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    mtp_drafted: int = 0  # MTP draft tokens proposed for this request (0: decoded without MTP)
    mtp_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    specprefill: SpecPrefillReport | None = None  # when SpecPrefill ran or was due


def default_config(model: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """A ServerConfig for `model` (default: the embedded tiny model), with field overrides: a
    name of a nested struct's field (EngineConfig, AdmissionConfig, MediaConfig, PromptConfig,
    RequestLimits; SpecPrefillConfig's with a `specprefill_` prefix) sets it there."""
    if model is None:
        from mlx_relay.testing.fixtures import default_model_path

        model = default_model_path()
    model = str(model)

    def take(struct: type[msgspec.Struct], prefix: str = "", skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        fields = set(struct.__struct_fields__) - skip
        return {k.removeprefix(prefix): overrides.pop(k) for k in list(overrides)
                if k.startswith(prefix) and k.removeprefix(prefix) in fields}

    sp_kw = take(SpecPrefillConfig, "specprefill_")
    engine_kw = take(EngineConfig, skip=frozenset({"model_path"}))
    admission_kw = take(AdmissionConfig, skip=frozenset({"max_num_seqs"}))
    if "max_num_seqs" in engine_kw:
        admission_kw["max_num_seqs"] = engine_kw["max_num_seqs"]
    name = overrides.pop("served_model_name", None) or _display_name(model)
    return ServerConfig(
        model=model,
        served_model_name=name,
        engine=EngineConfig(model_path=model, **engine_kw),
        admission=AdmissionConfig(**admission_kw),
        media=MediaConfig(**take(MediaConfig)),
        specprefill=SpecPrefillConfig(**sp_kw),
        prompts=PromptConfig(**take(PromptConfig)),
        limits=RequestLimits(**take(RequestLimits)),
        **overrides,
    )


def _display_name(model: str) -> str:
    p = Path(model)
    return p.name if p.is_dir() else model


class Relay:
    def __init__(self, config: ServerConfig, system: ActorSystem, admission: ActorRef) -> None:
        self.config = config
        self.system = system
        self.admission = admission
        self.service: ChatService | None = None
        self.info: ModelInfo | None = None
        self.state = "loading"
        self.error: BaseException | None = None
        self.ready = anyio.Event()  # set when ready or failed
        self.failed = anyio.Event()  # set when booting failed or an actor could not be restarted
        self.gpu: ActorRef | None = None

    # -- assembly ----------------------------------------------------------------------------------
    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        model: str | Path | None = None,
        *,
        config: ServerConfig | None = None,
        wait_ready: bool = True,
        on_progress: Callable[[str], None] | None = None,
        **overrides: Any,
    ) -> AsyncIterator[Relay]:
        cfg = config or default_config(model, **overrides)
        failed: BaseException | None = None
        async with ActorSystem() as system:
            admission = await system.spawn(lambda: Admission(cfg.admission), name="admission",
                                           accepts=Admission.accepts)
            relay = cls(cfg, system, admission)
            async with anyio.create_task_group() as tg:
                tg.start_soon(relay._boot, on_progress or (lambda m: log.info("%s", m)))
                tg.start_soon(relay._watch_actors)
                if wait_ready:
                    await relay.ready.wait()
                    failed = relay.error
                if failed is None:
                    try:
                        yield relay
                    finally:
                        tg.cancel_scope.cancel()
                else:
                    tg.cancel_scope.cancel()
        if failed is not None:  # raised here, outside the task groups, as itself
            raise failed

    async def _set_state(self, state: str, detail: str = "") -> None:
        self.state = state
        await self.admission.tell(SetState(state, detail))  # type: ignore[arg-type]

    async def _boot(self, progress: Callable[[str], None]) -> None:
        cfg = self.config
        try:
            path = await anyio.to_thread.run_sync(resolve_model_path, cfg.model)
            engine_cfg = msgspec.structs.replace(cfg.engine, model_path=str(path))
            gpu = self.gpu = await self.system.spawn(lambda: GPUExecutor(engine_cfg, progress), name="gpu",
                                                     accepts=GPUExecutor.accepts)
            normalizer = await self.system.spawn(lambda: Normalizer(path, cfg.prompts), name="normalizer",
                                                 accepts=Normalizer.accepts, capacity=Normalizer.mailbox_capacity)
            media = await self.system.spawn(lambda: MediaRouter(cfg.media, path), name="media",
                                            accepts=MediaRouter.accepts)
            self.info = await gpu.ask(Describe())
            store = None
            if self.info.prefix_cache_bytes > 0:
                store_cfg = PrefixCacheConfig(budget_bytes=self.info.prefix_cache_bytes,
                                              min_snapshot_tokens=cfg.engine.prefix_min_snapshot_tokens)
                store = await self.system.spawn(lambda: PrefixCacheStore(store_cfg, gpu), name="prefix-cache",
                                                accepts=PrefixCacheStore.accepts)
                await gpu.tell(AttachPrefixStore(store))
            scorer = None
            if cfg.specprefill.draft_model is not None:
                draft = await anyio.to_thread.run_sync(resolve_model_path, cfg.specprefill.draft_model)
                sp_cfg = msgspec.structs.replace(cfg.specprefill, draft_model=str(draft))
                scorer = await self.system.spawn(lambda: SpecPrefillScorer(sp_cfg, gpu), name="specprefill",
                                                 accepts=SpecPrefillScorer.accepts)
            gen_cfg_path = path / "generation_config.json"
            gen_cfg = json.loads(gen_cfg_path.read_text()) if gen_cfg_path.exists() else {}
            self.service = ChatService(
                admission=self.admission,
                normalizer=normalizer,
                media=media,
                gpu=gpu,
                info=self.info,
                defaults=SamplingDefaults.from_generation_config(gen_cfg),
                default_max_tokens=cfg.default_max_tokens,
                max_tokens_policy=cfg.limits.max_tokens_policy,
                prefix_store=store,
                scorer=scorer,
            )
            if cfg.engine.warmup:
                await self._set_state("warming")
                progress("warming kernels")
                await gpu.ask(Warmup())
            await self._set_state("ready")
            progress("ready")
        except Exception as exc:
            log.exception("boot failed")
            self.error = exc
            await self._set_state("failed", f"{type(exc).__name__}: {exc}")
            self.failed.set()
        finally:
            self.ready.set()

    async def _watch_actors(self) -> None:
        """An actor that cannot be restarted fails the whole relay (a supervisor restarts it)."""
        await self.system.failed.wait()
        self.error = SystemFailure(self.system.failure or "an actor failed")
        log.critical("%s; the server cannot recover", self.error)
        await self._set_state("failed", str(self.error))
        self.failed.set()

    # -- health and drain -----------------------------------------------------------------------------
    def health(self) -> Health:
        """loading / warming / ready / degraded (an actor is restarting) / draining / failed."""
        down = self.system.down()
        status = self.state
        if status == "ready" and down:
            status = "degraded"
        return Health(status, down, status == "ready")

    async def drain(self, timeout_s: float) -> DrainReport:
        """Stop admitting (new and queued requests get 503 + Retry-After), let the running ones
        finish for up to `timeout_s`, then end the rest with `ServerShuttingDown` (every stream
        still gets its terminal event)."""
        tic = time.monotonic()
        await self._set_state("draining")
        ended = 0
        with anyio.move_on_after(timeout_s):
            await self.admission.request(WhenIdle())
        if (await self.stats()).running and self.gpu is not None:
            ended = await self.gpu.ask(AbortAll(f"the server is shutting down: the request could not finish "
                                                f"within the {timeout_s:g}s drain"))
            with anyio.move_on_after(5.0):  # their responses write the terminal events and let go
                await self.admission.request(WhenIdle())
        return DrainReport(seconds=round(time.monotonic() - tic, 3), ended=ended)

    # -- the API -------------------------------------------------------------------------------------
    def _service(self) -> ChatService:
        if self.service is None:
            raise NotReady(f"the server is {self.state}")
        return self.service

    async def stats(self) -> AdmissionStats:
        return await self.admission.ask(GetStats())

    async def prefix_cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters (index and snapshot memory) and the vision feature cache's."""
        service = self._service()
        engine: EngineStats = await service.gpu.ask(GetEngineStats())
        body: dict[str, Any] = {
            "prefix_cache": {"enabled": False},
            "snapshots": {"held": engine.snapshots, "bytes": engine.snapshot_bytes},
            "vision_cache": {"hits": engine.vision_cache_hits, "misses": engine.vision_cache_misses,
                             "entries": engine.vision_cache_entries, "bytes": engine.vision_cache_bytes},
        }
        if service.prefix_store is not None:
            stats: PrefixStats = await service.prefix_store.ask(GetPrefixStats())
            body["prefix_cache"] = msgspec.to_builtins(stats)
        return body

    async def specprefill_stats(self) -> dict[str, Any]:
        """SpecPrefill's counters ({"enabled": False} without a draft model)."""
        service = self._service()
        if service.scorer is None:
            return {"enabled": False}
        return {"enabled": True, **msgspec.to_builtins(await service.scorer.ask(GetSpecPrefillStats()))}

    async def flush_prefix_cache(self) -> Flushed:
        """Drop every prefix-cache snapshot no request is using."""
        service = self._service()
        if service.prefix_store is None:
            return Flushed(0, 0)
        return await service.prefix_store.ask(Flush())

    async def chat(self, messages: Sequence[ChatMessage | dict[str, Any]], **params: Any) -> ChatResult:
        """Complete a chat; params are ChatRequest fields (max_tokens, temperature, stop, ...)."""
        req = _request(messages, params)
        parts: list[str] = []
        ids: list[int] = []
        async with self._service().generate(req) as events:
            async for ev in events:
                if isinstance(ev, TokenDelta):
                    parts.append(ev.text)
                    ids.extend(ev.token_ids)
                elif isinstance(ev, Finished):
                    return ChatResult("".join(parts), ev.reason, ev.prompt_tokens, ev.completion_tokens, ids,
                                      ev.mtp_drafted, ev.mtp_accepted, ev.cached_tokens, ev.specprefill)
        raise RuntimeError("generation ended without a finish event")

    async def stream_chat(
        self, messages: Sequence[ChatMessage | dict[str, Any]], **params: Any
    ) -> AsyncIterator[str]:
        """Yield text deltas as they are generated."""
        req = _request(messages, params)
        async with self._service().generate(req) as events:
            async for ev in events:
                if isinstance(ev, TokenDelta) and ev.text:
                    yield ev.text


def _request(messages: Sequence[ChatMessage | dict[str, Any]], params: dict[str, Any]) -> ChatRequest:
    """A ChatRequest from the API's arguments (dicts or structs, checked like an HTTP body's)."""
    stop = params.get("stop")
    fields = {**params, "messages": list(messages), "stop": (stop,) if isinstance(stop, str) else tuple(stop or ())}
    try:
        return msgspec.convert(fields, ChatRequest)
    except msgspec.ValidationError as exc:
        raise UnprocessableRequest(str(exc)) from None

"""Relay: the assembled server core, usable in-process or behind HTTP.

    async with Relay.start(model="path/or/repo") as relay:
        reply = await relay.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        async for delta in relay.stream_chat([...]):
            print(delta, end="")

`start` spawns the actors (Admission first, so the server can answer 503 while the model
loads; then the GPUExecutor, which loads the model on its thread; the Normalizer), warms the
kernels and marks the server ready. `wait_ready=False` returns at once and boots in the
background (what the HTTP server does, so `/health` reports loading/warming).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec

from mlx_relay.actors.admission import Admission, AdmissionStats, GetStats, SetState
from mlx_relay.actors.gpu_executor import AttachPrefixStore, GPUExecutor
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
from mlx_relay.config import AdmissionConfig, EngineConfig, MediaConfig, ServerConfig, SpecPrefillConfig
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
from mlx_relay.errors import NotReady
from mlx_relay.runtime import ActorRef, ActorSystem
from mlx_relay.service import ChatRequest, ChatService, SamplingDefaults

log = logging.getLogger(__name__)


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
    """A ServerConfig for `model` (default: the embedded tiny model), with field overrides."""
    if model is None:
        from mlx_relay.testing.fixtures import default_model_path

        model = default_model_path()
    model = str(model)
    engine_keys = set(EngineConfig.__struct_fields__) - {"model_path"}
    admission_keys = set(AdmissionConfig.__struct_fields__)
    media_keys = set(MediaConfig.__struct_fields__)
    media_kw = {k: overrides.pop(k) for k in list(overrides) if k in media_keys}
    sp_kw = {k.removeprefix("specprefill_"): overrides.pop(k) for k in list(overrides)
             if k.startswith("specprefill_") and k.removeprefix("specprefill_") in SpecPrefillConfig.__struct_fields__}
    engine_kw = {k: overrides.pop(k) for k in list(overrides) if k in engine_keys}
    admission_kw = {k: overrides.pop(k) for k in list(overrides) if k in admission_keys and k != "max_num_seqs"}
    if "max_num_seqs" in engine_kw:
        admission_kw["max_num_seqs"] = engine_kw["max_num_seqs"]
    name = overrides.pop("served_model_name", None) or _display_name(model)
    return ServerConfig(
        model=model,
        served_model_name=name,
        engine=EngineConfig(model_path=model, **engine_kw),
        admission=AdmissionConfig(**admission_kw),
        media=MediaConfig(**media_kw),
        specprefill=SpecPrefillConfig(**sp_kw),
        **overrides,
    )


def _display_name(model: str) -> str:
    p = Path(model)
    return p.name if p.is_dir() else model


def _to_messages(messages: Sequence[ChatMessage | dict[str, Any]]) -> list[ChatMessage]:
    return [m if isinstance(m, ChatMessage) else msgspec.convert(m, ChatMessage) for m in messages]


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
            gpu = await self.system.spawn(lambda: GPUExecutor(engine_cfg, progress), name="gpu",
                                          accepts=GPUExecutor.accepts)
            normalizer = await self.system.spawn(lambda: Normalizer(path, cfg.tool_parser), name="normalizer",
                                                 accepts=Normalizer.accepts)
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
        finally:
            self.ready.set()

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
        req = ChatRequest(messages=_to_messages(messages), **_coerce(params))
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
        req = ChatRequest(messages=_to_messages(messages), **_coerce(params))
        async with self._service().generate(req) as events:
            async for ev in events:
                if isinstance(ev, TokenDelta) and ev.text:
                    yield ev.text


def _coerce(params: dict[str, Any]) -> dict[str, Any]:
    out = dict(params)
    stop = out.get("stop")
    if isinstance(stop, str):
        out["stop"] = (stop,)
    elif stop is not None:
        out["stop"] = tuple(stop)
    return out

"""Relay: the assembled server core, usable in-process or behind HTTP.

    async with Relay.start(model="path/or/repo") as relay:
        reply = await relay.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        print(reply.content, reply.tool_calls, reply.usage)
        async for event in relay.stream_chat([...]):
            if isinstance(event, ContentDelta):
                print(event.text, end="")

`start` spawns the actors (Admission first, so the server can answer 503 while the model
loads; then the GPUExecutor, which loads the model on its thread; the Normalizer), warms the
kernels and marks the server ready. `wait_ready=False` returns at once and boots in the
background (what the HTTP server does, so `/health` reports loading/warming).

`health()` tells the truth about the actors: crashed ones restart on their own (the server is
"degraded" meanwhile); if one cannot be restarted the relay is "failed" and `failed` is set (the
HTTP server then exits non-zero). `drain()` is the graceful stop: no new requests, the running
ones finish within a deadline, the rest are ended with a retryable error, then the prefix cache is
flushed (`Flush`: the hook for a cache tier that outlives the process).

`metrics` is the server's own (`mlx_relay.metrics.ServerMetrics`): the ChatService observes the
request path into it, and `scrape()` adds what the actors count (asked at scrape time).
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

from mlx_relay.actors.admission import Admission
from mlx_relay.actors.gpu_executor import GPUExecutor, GPUPeers
from mlx_relay.actors.media_router import MediaRouter
from mlx_relay.actors.normalizer import Normalizer
from mlx_relay.actors.prefix_cache_store import PrefixCacheConfig, PrefixCacheStore
from mlx_relay.actors.prefix_disk_tier import DiskTierConfig
from mlx_relay.actors.specprefill_scorer import SpecPrefillScorer
from mlx_relay.actors.text_mtp_executor import TextMTPExecutor
from mlx_relay.actors.vision_executor import VisionExecutor
from mlx_relay.chat.output import ReplyEvent
from mlx_relay.chat.reply import ChatReply, ReplyCollector
from mlx_relay.chat.types import ChatMessage
from mlx_relay.config import ServerConfig, build_config
from mlx_relay.default_model import DEFAULT_MODEL_NAME, default_model_path
from mlx_relay.embeddings import EmbeddingResult
from mlx_relay.engine.models.checkpoint import resolve_model_path
from mlx_relay.engine.protocol import ResetPeakMemory
from mlx_relay.errors import EmbeddingsUnavailable, NotReady, UnprocessableRequest
from mlx_relay.messages.admission import AdmissionStats, GetStats, SetState, WhenIdle
from mlx_relay.messages.gpu import (
    AbortAll,
    Describe,
    EngineStats,
    GetEngineStats,
    ModelInfo,
    Warmup,
)
from mlx_relay.messages.prefix_cache import (
    Flush,
    Flushed,
    GetPrefixStats,
    Persisted,
    PersistPrefixCache,
    PrefixStats,
    PreloadPrefixCache,
)
from mlx_relay.messages.prompt import DescribePrompts, PromptFeatures
from mlx_relay.messages.specprefill import GetSpecPrefillStats
from mlx_relay.messages.text_mtp import GetMTPStats, MTPCalibration
from mlx_relay.messages.vision import GetVisionStats, VisionStats
from mlx_relay.metrics import ServerMetrics, StatsSnapshot
from mlx_relay.metrics.gather import gather_stats
from mlx_relay.runtime import ActorRef, ActorSystem
from mlx_relay.runtime.supervision import RestartPolicy
from mlx_relay.service import Actors, ChatRequest, ChatService, EngineEvents, ReplyTally, SamplingDefaults

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
    flushed: Flushed | None = None  # the prefix cache's flush, the drain's last step (None: no cache)
    persisted: Persisted | None = None  # the disk tier's writes before the flush (None: no disk tier)


def default_config(model: str | Path | None = None, **overrides: Any) -> ServerConfig:
    """`config.build_config` for `model` (default: the embedded model, served as its name)."""
    if model is None:
        overrides.setdefault("served_model_name", DEFAULT_MODEL_NAME)
        model = default_model_path()
    return build_config(model, **overrides)


class Relay:
    def __init__(self, config: ServerConfig, system: ActorSystem, admission: ActorRef,
                 metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.system = system
        self.admission = admission
        self.service: ChatService | None = None
        self.info: ModelInfo | None = None
        self.prompt_features: PromptFeatures | None = None  # what the chat template supports (tools, reasoning)
        self.metrics = metrics or ServerMetrics(config.served_model_name)
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
        metrics: ServerMetrics | None = None,
        **overrides: Any,
    ) -> AsyncIterator[Relay]:
        """`metrics`: the request-path series to observe into (a pooled model keeps its own across
        loads); None: a registry of this relay's own."""
        cfg = config or default_config(model, **overrides)
        failed: BaseException | None = None
        async with ActorSystem() as system:
            admission = await system.spawn(Admission, cfg.admission, cfg.engine.max_num_seqs, name="admission")
            relay = cls(cfg, system, admission, metrics)
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
        """The actor graph, in dependency order. The GPUExecutor reports to the policy actors and
        they tell it what to free, so their references are reserved before it starts."""
        cfg, system = self.config, self.system
        try:
            path = await anyio.to_thread.run_sync(resolve_model_path, cfg.model)
            engine_cfg = msgspec.structs.replace(cfg.engine, model_path=str(path))
            if engine_cfg.draft_model is not None:
                spec_draft = await anyio.to_thread.run_sync(resolve_model_path, engine_cfg.draft_model)
                engine_cfg = msgspec.structs.replace(engine_cfg, draft_model=str(spec_draft))
            if engine_cfg.embedding_model is not None:  # named as given (a Hub id's name, not its snapshot's)
                embed = await anyio.to_thread.run_sync(resolve_model_path, engine_cfg.embedding_model)
                engine_cfg = msgspec.structs.replace(engine_cfg, embedding_model=str(embed),
                                                     embedding_model_name=engine_cfg.embedding_names[0])
            sp_cfg = cfg.specprefill
            if sp_cfg.draft_model is not None:
                draft = await anyio.to_thread.run_sync(resolve_model_path, sp_cfg.draft_model)
                sp_cfg = msgspec.structs.replace(sp_cfg, draft_model=str(draft))
            store = system.reserve(PrefixCacheStore, name="prefix-cache") if engine_cfg.prefix_cache else None
            scorer = system.reserve(SpecPrefillScorer, name="specprefill") if sp_cfg.draft_model else None
            text = system.reserve(TextMTPExecutor, name="text-mtp")
            vision = system.reserve(VisionExecutor, name="vision")
            # a pipeline's engine is not restarted in its process (GPUExecutor): one refused start fails it
            policy = RestartPolicy(max_start_failures=1) if engine_cfg.pipeline.enabled else None
            gpu = self.gpu = await system.spawn(GPUExecutor, engine_cfg, sp_cfg, GPUPeers(store, scorer, text, vision),
                                                progress, name="gpu", policy=policy)
            info = self.info = await gpu.ask(Describe())
            await system.start(text, engine_cfg, info)
            await system.start(vision, engine_cfg, gpu)
            if store is not None:
                disk = None
                if engine_cfg.prefix_cache_dir is not None and info.snapshot_identity is not None:
                    disk = DiskTierConfig(engine_cfg.prefix_cache_dir, engine_cfg.prefix_cache_disk_bytes,
                                          info.snapshot_identity)
                store_cfg = PrefixCacheConfig(info.prefix_cache_bytes, cfg.engine.prefix_min_snapshot_tokens,
                                              disk=disk, preload=engine_cfg.prefix_cache_preload)
                await system.start(store, store_cfg, gpu)
            if scorer is not None:
                await system.start(scorer, sp_cfg)
            media = await system.spawn(MediaRouter, cfg.media, path, name="media")
            normalizer = await system.spawn(Normalizer, path, cfg.prompts, media, name="normalizer")
            self.prompt_features = await normalizer.ask(DescribePrompts())
            gen_cfg_path = path / "generation_config.json"
            gen_cfg = json.loads(gen_cfg_path.read_text()) if gen_cfg_path.exists() else {}
            actors = Actors(self.admission, normalizer, gpu, text, vision if info.has_vision else None, store, scorer)
            self.service = ChatService(actors, info, SamplingDefaults.from_generation_config(gen_cfg),
                                       default_max_tokens=cfg.default_max_tokens,
                                       max_tokens_policy=cfg.limits.max_tokens_policy,
                                       tool_grammar=cfg.prompts.tool_grammar,
                                       metrics=self.metrics.requests)
            if cfg.engine.warmup:
                await self._set_state("warming")
                progress("warming kernels")
                report = await gpu.ask(Warmup())
                if report.mtp_round_cost is not None:
                    await text.ask(MTPCalibration(report.mtp_round_cost))
            await self._set_state("ready")
            progress("ready")
            if store is not None:  # the disk tier warms the memory tier, behind readiness
                await store.tell(PreloadPrefixCache())
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
        still gets its terminal event), and flush the prefix cache (`_flush_for_exit`)."""
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
        persisted = await self._persist_for_exit()
        flushed = await self._flush_for_exit()
        return DrainReport(seconds=round(time.monotonic() - tic, 3), ended=ended, flushed=flushed,
                           persisted=persisted)

    async def _persist_for_exit(self) -> Persisted | None:
        """Before the flush: the disk tier (`--prefix-cache-dir`) writes what it holds only in
        memory and waits for its writes under way (30 s at most), so the next process restores
        the warm sessions. None without a disk tier, or if the store cannot answer."""
        if self.service is None or self.service.prefix_store is None or self.config.engine.prefix_cache_dir is None:
            return None
        try:
            with anyio.fail_after(35.0):
                return await self.persist_prefix_cache(30.0)
        except Exception as exc:
            log.warning("the prefix cache's disk tier could not be written at exit: %s", type(exc).__name__)
            return None

    async def _flush_for_exit(self) -> Flushed | None:
        """The drain's last step, once no request runs: the PrefixCacheStore's `Flush` (where a
        tier of the cache that outlives the process writes out what it holds before the snapshots
        are dropped). A store that cannot answer does not hold the exit up."""
        if self.service is None or self.service.prefix_store is None:
            return None
        try:
            with anyio.fail_after(30.0):
                return await self.flush_prefix_cache()
        except Exception as exc:
            log.warning("the prefix cache could not be flushed at exit: %s", type(exc).__name__)
            return None

    # -- the API -------------------------------------------------------------------------------------
    def _service(self) -> ChatService:
        if self.service is None:
            raise NotReady(f"the server is {self.state}")
        return self.service

    async def stats(self) -> AdmissionStats:
        return await self.admission.ask(GetStats())

    async def scrape(self) -> bytes:
        """The Prometheus exposition: the request path's series and what the actors count now
        (only Admission's while the model loads)."""
        return self.metrics.render(await self.stats_snapshot())

    async def stats_snapshot(self) -> StatsSnapshot:
        """What the actors count now, as one scrape gathers it (only Admission's while loading)."""
        actors = self.service.actors if self.service is not None else None
        return await gather_stats(self.health().status, self.admission, actors)

    async def prefix_cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters (index and snapshot memory) and the vision feature cache's.
        The store is asked first: whatever it told the GPUExecutor to free before answering is
        freed in the engine's answer after it (mailboxes are in order)."""
        actors = self._service().actors
        prefix: dict[str, Any] = {"enabled": False}
        if actors.prefix_store is not None:
            stats: PrefixStats = await actors.prefix_store.ask(GetPrefixStats())
            prefix = msgspec.to_builtins(stats)
        engine: EngineStats = await actors.gpu.ask(GetEngineStats())
        body: dict[str, Any] = {
            "prefix_cache": prefix,
            "snapshots": {"held": engine.snapshots, "bytes": engine.snapshot_bytes},
            "vision_cache": {"hits": 0, "misses": 0, "entries": 0, "bytes": 0},
        }
        if actors.vision is not None:
            vision: VisionStats = await actors.vision.ask(GetVisionStats())
            body["vision_cache"] = {"hits": vision.hits, "misses": vision.misses, "entries": vision.entries,
                                    "bytes": vision.bytes}
        return body

    async def mtp_stats(self) -> dict[str, Any]:
        """MTP speculative decoding's counters (the TextMTPExecutor's)."""
        stats = await self._service().actors.text.ask(GetMTPStats())
        return {**msgspec.to_builtins(stats), "acceptance": round(stats.acceptance, 4)}

    async def engine_stats(self) -> EngineStats:
        """What the GPU thread holds and has counted."""
        stats: EngineStats = await self._service().actors.gpu.ask(GetEngineStats())
        return stats

    async def reset_peak_memory(self) -> int:
        """Start the engine's peak-memory count (`EngineStats.peak_memory_bytes`, the
        `gpu_memory_peak_bytes` metric) over, e.g. between benchmark runs; the peak until now (bytes)."""
        peak: int = await self._service().actors.gpu.ask(ResetPeakMemory())
        return peak

    async def specprefill_stats(self) -> dict[str, Any]:
        """SpecPrefill's counters ({"enabled": False} without a draft model)."""
        scorer = self._service().scorer
        if scorer is None:
            return {"enabled": False}
        return {"enabled": True, **msgspec.to_builtins(await scorer.ask(GetSpecPrefillStats()))}

    async def flush_prefix_cache(self) -> Flushed:
        """Drop every prefix-cache snapshot no request is using."""
        service = self._service()
        if service.prefix_store is None:
            return Flushed(0, 0)
        return await service.prefix_store.ask(Flush())

    async def persist_prefix_cache(self, timeout_s: float = 30.0) -> Persisted:
        """The drain's hook for the prefix cache's disk tier: write every snapshot held in memory
        that is worth keeping and not on disk yet, and wait for the writes under way, within
        `timeout_s` (what is left is counted in `pending`). Persisted(enabled=False) without
        `prefix_cache_dir`; safe to call at any time, also while requests run."""
        service = self._service()
        if service.prefix_store is None:
            return Persisted(False)
        result: Persisted = await service.prefix_store.request(PersistPrefixCache(timeout_s))
        return result

    @asynccontextmanager
    async def generate(self, request: ChatRequest, request_id: str | None = None) -> AsyncIterator[EngineEvents]:
        """Admit and start one request: its stream of TokenDelta ..., Finished (the harness's way in)."""
        async with self._service().generate(request, request_id) as events:
            yield events

    async def chat(self, messages: Sequence[ChatMessage | dict[str, Any]], **params: Any) -> ChatReply:
        """Complete a chat, parsed as the HTTP routes parse it: content, reasoning, tool calls and
        usage (`mlx_relay.chat.reply.ChatReply`); params are ChatRequest fields (max_tokens,
        temperature, stop, tools, ...). The reply's raw text and token ids ride along."""
        tally = ReplyTally(keep_text=True, keep_tokens=True)
        collector = ReplyCollector()
        async with self._service().reply(_request(messages, params), tally=tally) as events:
            async for ev in events:
                collector.feed(ev)
        return collector.reply(raw_text="".join(tally.pieces), token_ids=tally.token_ids)

    async def stream_chat(
        self, messages: Sequence[ChatMessage | dict[str, Any]], **params: Any
    ) -> AsyncIterator[ReplyEvent]:
        """Yield the reply's typed events as they are generated (`mlx_relay.chat.output`):
        `ReplyStarted`, then `ReasoningDelta` / `ContentDelta` / `ToolCallStart`,
        `ToolCallArguments`, `ToolCallEnd` in the order the model wrote them, `ReplyDone` last."""
        async with self._service().reply(_request(messages, params)) as events:
            async for ev in events:
                yield ev

    async def embed(self, inputs: list[str] | list[list[int]]) -> EmbeddingResult:
        """The embedding model's unit vectors of `inputs` (texts or token ids), as `/v1/embeddings`'s."""
        if (embeddings := self._service().embeddings) is None:
            raise EmbeddingsUnavailable("this relay has no embedding model (embedding_model)")
        return await embeddings.embed(inputs)


def _request(messages: Sequence[ChatMessage | dict[str, Any]], params: dict[str, Any]) -> ChatRequest:
    """A ChatRequest from the API's arguments (dicts or structs, checked like an HTTP body's)."""
    stop = params.get("stop")
    fields = {**params, "messages": list(messages), "stop": (stop,) if isinstance(stop, str) else tuple(stop or ())}
    try:
        return msgspec.convert(fields, ChatRequest)
    except msgspec.ValidationError as exc:
        raise UnprocessableRequest(str(exc)) from None

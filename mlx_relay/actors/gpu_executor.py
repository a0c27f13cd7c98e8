"""GPUExecutor: the actor that owns the model and the one thread every MLX operation runs on.

On the event loop it keeps the reply stream of each request; on its `GPUThread` it loads the
model, warms the kernels and runs the `BatchEngine`. Requests arrive as `Generate` stream
messages; the thread posts each step's events back to the loop in one call, where they are
routed to their streams. A cancelled stream removes its row from the batch at the next step
boundary. If the thread dies, the actor crashes and its supervisor restarts it (reloading the
model); the requests it held get an error, new ones are served by the fresh instance.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec

from mlx_relay.config import EngineConfig
from mlx_relay.engine.batch_engine import BatchEngine, Event
from mlx_relay.engine.gpu_thread import GPUThread
from mlx_relay.engine.loader import LoadedModel, apply_memory_limits, default_prefix_cache_bytes, load_model
from mlx_relay.engine.messages import (
    CancelScoring,
    Describe,
    Finished,
    FreeSnapshots,
    Generate,
    GetEngineStats,
    LoadDraft,
    ModelInfo,
    PromptScored,
    ScorePrompt,
    SnapshotTaken,
    TokenDelta,
    Warmup,
)
from mlx_relay.errors import ServerShuttingDown
from mlx_relay.runtime import Actor, ActorRef, ReplyStream

log = logging.getLogger(__name__)


class AttachPrefixStore(msgspec.Struct, frozen=True):
    """Tell: where to report the prefix-cache snapshots the engine takes (the PrefixCacheStore)."""

    store: ActorRef


class AbortAll(msgspec.Struct, frozen=True):
    """Ask (the drain's deadline): end every generation with `ServerShuttingDown(reason)` and
    refuse new ones the same way. Reply: how many were ended."""

    reason: str


class AttachScorer(msgspec.Struct, frozen=True):
    """Tell: where to report SpecPrefill scoring outcomes (the SpecPrefillScorer)."""

    scorer: ActorRef


class GPUExecutor(Actor):
    accepts = (Generate, Describe, Warmup, GetEngineStats, FreeSnapshots, AttachPrefixStore, LoadDraft, ScorePrompt,
               CancelScoring, AttachScorer, AbortAll)
    mailbox_capacity = 1024

    def __init__(self, config: EngineConfig, on_progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._on_progress = on_progress or (lambda _msg: None)
        self._streams: dict[int, ReplyStream] = {}
        self._thread: GPUThread | None = None
        self._engine: BatchEngine | None = None
        self._store: ActorRef | None = None
        self._scorer: ActorRef | None = None
        self._aborting: str | None = None  # the drain's deadline passed: every generation ends
        self.info: ModelInfo | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        ref = self.ref

        def on_fatal(exc: BaseException) -> None:
            loop.call_soon_threadsafe(ref.crash, f"GPU thread died: {type(exc).__name__}: {exc}")

        def emit(events: list[Event]) -> None:
            loop.call_soon_threadsafe(self._deliver, events)

        self._thread = GPUThread("mlx-gpu", on_fatal)
        self._thread.start()
        await asyncio.wrap_future(self._thread.submit(apply_memory_limits, self.config))
        self._on_progress(f"loading {self.config.model_path}")
        loaded: LoadedModel = await asyncio.wrap_future(
            self._thread.submit(load_model, Path(self.config.model_path))
        )
        budget = 0
        if self.config.prefix_cache:
            budget = self.config.prefix_cache_bytes
            if budget is None:
                budget = await asyncio.wrap_future(self._thread.submit(default_prefix_cache_bytes))
        context = loaded.info.context_length
        if self.config.max_model_len is not None:
            context = min(context, self.config.max_model_len)
        self.info = msgspec.structs.replace(loaded.info, prefix_cache_bytes=budget, context_length=context)
        self._engine = await asyncio.wrap_future(
            self._thread.submit(
                lambda: BatchEngine(
                    loaded,
                    max_num_seqs=self.config.max_num_seqs,
                    prefill_batch_size=self.config.prefill_batch_size,
                    prefill_step_size=self.config.prefill_step_size,
                    seed=self.config.seed,
                    emit=emit,
                    vision_cache_bytes=self.config.vision_cache_bytes,
                    mtp=self.config.mtp,
                    mtp_block_size=self.config.mtp_block_size,
                    mtp_max_batch=self.config.mtp_max_batch,
                    mtp_verify=self.config.mtp_verify,
                    prefix_cache=budget > 0,
                )
            )
        )
        self._thread.stepper = self._engine
        self._on_progress(f"loaded in {loaded.info.load_seconds:.1f}s")

    async def on_stop(self) -> None:
        thread, engine = self._thread, self._engine
        self._thread = self._engine = None
        if thread is None:
            return
        if engine is not None:
            try:
                await asyncio.wrap_future(thread.submit(engine.close))
            except Exception:
                log.exception("engine close failed")
        await asyncio.to_thread(thread.stop, 30.0)
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    # -- messages ----------------------------------------------------------------------------------
    async def receive(self, msg: object, stream: ReplyStream | None) -> object:
        assert self._thread is not None and self._engine is not None
        match msg:
            case Generate():
                assert stream is not None
                if self._aborting is not None:
                    raise ServerShuttingDown(self._aborting)
                self._streams[stream.id] = stream
                self._thread.submit(self._engine.add, stream.id, msg)
                return None
            case Describe():
                return self.info
            case Warmup():
                await self._warmup()
                return None
            case GetEngineStats():
                return await asyncio.wrap_future(self._thread.submit(self._engine.stats))
            case FreeSnapshots():
                self._thread.submit(self._engine.free_snapshots, msg.handles, msg.release_memory)
                return None
            case AttachPrefixStore():
                self._store = msg.store
                return None
            case LoadDraft():
                self._on_progress(f"loading the SpecPrefill draft {msg.path}")
                return await asyncio.wrap_future(self._thread.submit(self._engine.load_draft, msg.path))
            case ScorePrompt():
                self._thread.submit(self._engine.score, msg)
                return None
            case CancelScoring():
                self._thread.submit(self._engine.cancel_scoring, msg.request_id)
                return None
            case AttachScorer():
                self._scorer = msg.scorer
                return None
            case AbortAll(reason=reason):
                self._aborting = reason
                ended = list(self._streams.items())
                self._streams.clear()
                for sid, open_stream in ended:
                    open_stream.fail(ServerShuttingDown(reason))
                    self._thread.submit(self._engine.cancel, sid)
                return len(ended)
        raise TypeError(type(msg).__name__)

    def on_cancel(self, stream: ReplyStream) -> None:
        if self._streams.pop(stream.id, None) is not None and self._thread and self._engine:
            self._thread.submit(self._engine.cancel, stream.id)

    def _deliver(self, events: list[Event]) -> None:
        """On the event loop: route one step's events to their streams."""
        for sid, event in events:
            if isinstance(event, SnapshotTaken):
                self._forward_snapshot(event)
                continue
            if isinstance(event, PromptScored):
                # the scorer's mailbox holds far more than the requests that can be scoring at once
                if self._scorer is None or not self._scorer.tell_nowait(event):
                    log.error("SpecPrefill scores for %s could not be delivered", event.request_id)
                continue
            stream = self._streams.get(sid)
            if stream is None:
                continue
            if isinstance(event, TokenDelta):
                stream.send(event)
            elif isinstance(event, Finished):
                stream.send(event)
                stream.close()
                del self._streams[sid]
            else:
                stream.fail(event)
                del self._streams[sid]

    def _forward_snapshot(self, snap: SnapshotTaken) -> None:
        """To the PrefixCacheStore, without waiting; a snapshot nobody can take is freed at once."""
        from mlx_relay.actors.prefix_cache_store import Insert

        if self._store is not None and self._store.tell_nowait(Insert(snap)):
            return
        if self._thread is not None and self._engine is not None:
            self._thread.submit(self._engine.free_snapshots, [snap.handle])

    async def _warmup(self) -> None:
        assert self._thread is not None and self._engine is not None
        seconds = await asyncio.wrap_future(self._thread.submit(self._engine.warmup))
        log.info("warm-up took %.1fs", seconds)


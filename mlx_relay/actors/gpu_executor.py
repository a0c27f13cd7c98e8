"""GPUExecutor: the actor that owns the device; every MLX operation runs on its engine's one thread.

    requester --Generate (stream)--> GPUExecutor --> TokenDelta ..., Finished
    EmbeddingService --Embed (stream)--> GPUExecutor --> EmbeddedVectors
    GPUExecutor --SnapshotTaken--> PrefixCacheStore --FreeSnapshots--> GPUExecutor
    PrefixCacheStore --SaveSnapshot / LoadSnapshot--> GPUExecutor --SnapshotSaved / SnapshotLoaded--> store
    GPUExecutor --FeaturesEncoded--> VisionExecutor --FreeFeatures--> GPUExecutor
    GPUExecutor --ScoringOutcome--> SpecPrefillScorer;  --MTPOutcome--> TextMTPExecutor

It executes what the policy actors decided (each `Generate` carries their plans) and reports
back what it did; it decides nothing about what is cached or how a request decodes. On the event
loop it keeps the reply stream of each request; its engine (`engine/hosting/handle.py`: a `GPUThread`
stepping the `EngineCore`) loads the model (and SpecPrefill's draft model, which scores prompts
here, where it lives), warms the kernels and steps. The engine runs on a thread of this process,
or in a process of its own (`EngineConfig.engine_process`; "auto": on a GPU), where no Python of
the server (HTTP, SSE encoding, the other actors) shares the GIL with the thread that launches
the kernels; commands and outputs then cross a pipe as msgpack frames (`engine/hosting/wire.py`), and the
message handling here is the same either way: each actor message becomes the engine's commands
(`engine/protocol.py`) in `receive`, the one place that knows both. Each step's `StepOutput` is posted to the loop in
one call and routed: stream events to their streams, side results to the actors that own them
(references given at construction). A cancelled stream removes its row at the next step
boundary. If the engine dies (its thread fails, its process is killed, a pipeline rank dies), the
requests it held end with `GenerationFailed` and the actor crashes; its supervisor restarts it (a
fresh thread or process reloads the model) and new requests are served by the fresh instance. A
pipeline's engine is never restarted in the same process (its process group is joined once, and
the other ranks cannot rejoin it): the restart is refused, the actor is failed, and the server
exits non-zero for its supervisor to restart every rank.

The prefix cache's disk tier (the store decides, this actor executes, the engine does the I/O
where it runs, so snapshot bytes never cross the pipe): a snapshot to write is copied to host
bytes on the GPU thread, between steps (one copy of arrays already evaluated), and written by a
writer thread, one file at a time; host copies waiting for the disk are bounded here
(`EngineConfig.prefix_cache_disk_queue_bytes`), past that a write is dropped and reported, never
waited for. A file to load is checked and checksummed by a reader thread (which also brings it
into the page cache), then loaded by MLX on the GPU thread (one copy from memory), each tensor
checked against the model's cache layout (probed at start, when the disk tier is on). A file
that fails any check is reported, never loaded into a request and never a crash.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import anyio

from mlx_relay.config import EngineConfig, SpecPrefillConfig
from mlx_relay.engine.hosting.engine_process import EngineProcessDied
from mlx_relay.engine.hosting.gpu_thread import GPUThreadDied
from mlx_relay.engine.hosting.handle import EngineCallbacks, EngineHandle
from mlx_relay.engine.hosting.placement import open_engine, wants_process
from mlx_relay.engine.protocol import (
    AddEmbedding,
    AddRow,
    Asked,
    BootEngine,
    CancelRow,
    CloseEngine,
    FreeFeatureHashes,
    FreeSnapshotHandles,
    ReadSnapshot,
    ReadStats,
    RunWarmup,
    StepOutput,
    WriteSnapshot,
)
from mlx_relay.errors import GenerationFailed, InvalidRequest, PipelineSetupError, ServerShuttingDown
from mlx_relay.messages.gpu import (
    AbortAll,
    Describe,
    Embed,
    EmbeddedVectors,
    Finished,
    Generate,
    GetEngineStats,
    ModelInfo,
    TokenDelta,
    Warmup,
)
from mlx_relay.messages.prefix_cache import FreeSnapshots, LoadSnapshot, SaveSnapshot, SnapshotLoaded, SnapshotSaved
from mlx_relay.messages.vision import FreeFeatures
from mlx_relay.runtime import Actor, ActorRef, ReplyStream, RuntimeFault

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUPeers:
    """The actors the GPUExecutor reports to (None: that feature is off)."""

    prefix_store: ActorRef | None = None
    scorer: ActorRef | None = None
    text: ActorRef | None = None
    vision: ActorRef | None = None


class GPUExecutor(Actor):
    # beside its own messages, any asked command of the engine's protocol that only the engine
    # handles (not a host's own): passed on as it is, answered with the engine's answer
    accepts = (Generate, Embed, Describe, Warmup, GetEngineStats, FreeSnapshots, FreeFeatures, AbortAll,
               SaveSnapshot, LoadSnapshot, Asked)
    mailbox_capacity = 1024

    def __init__(self, config: EngineConfig, specprefill: SpecPrefillConfig, peers: GPUPeers,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.specprefill = specprefill
        self.peers = peers
        self._on_progress = on_progress or (lambda _msg: None)
        self._streams: dict[int, ReplyStream] = {}
        self._engine: EngineHandle | None = None
        self._aborting: str | None = None  # the drain's deadline passed: every generation ends
        self.info: ModelInfo | None = None
        self._write_pending = 0  # bytes of snapshot copies waiting for the disk

    @property
    def engine(self) -> EngineHandle | None:
        """The engine this actor runs (None: not started, or stopped)."""
        return self._engine

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None: the engine runs on a thread of this process, or none runs)."""
        return self._engine.pid if self._engine is not None else None

    # -- lifecycle -------------------------------------------------------------------------------
    async def on_start(self) -> None:
        if self.config.pipeline.enabled and self.cell.restarts > 0:
            raise PipelineSetupError("a pipeline's engine is not restarted in its process (the process group is "
                                     "joined once): restart every rank")
        loop = asyncio.get_running_loop()
        ref = self.ref
        callbacks = EngineCallbacks(
            on_output=lambda out: loop.call_soon_threadsafe(self._deliver, out),
            on_fatal=lambda reason: loop.call_soon_threadsafe(self._engine_died, ref, reason),
            on_progress=lambda text: loop.call_soon_threadsafe(self._on_progress, text))
        # (off the loop: deciding where the engine runs may ask MLX in a throwaway process)
        engine = open_engine(await anyio.to_thread.run_sync(wants_process, self.config), callbacks)
        try:
            await anyio.to_thread.run_sync(engine.start)
            log.info("engine %s", "on a thread of this process" if engine.pid is None
                     else f"in a process of its own (pid {engine.pid})")
            self.info = await asyncio.wrap_future(engine.ask(BootEngine(self.config, self.specprefill)))
        except BaseException:
            with anyio.CancelScope(shield=True):  # a failed start leaves no thread busy, no process behind
                await anyio.to_thread.run_sync(engine.stop, 5.0)
            raise
        self._engine = engine

    async def on_stop(self) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            self._deliver(await asyncio.wrap_future(engine.ask(CloseEngine())))
        except (GPUThreadDied, EngineProcessDied) as exc:  # it died: nothing to close
            log.info("engine not closed: %s", exc)
        except Exception:
            log.exception("engine close failed")
        await anyio.to_thread.run_sync(engine.stop, 30.0)
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    # -- messages: each actor message becomes the engine's commands here ---------------------------
    async def receive(self, msg: object, stream: ReplyStream | None) -> object:
        engine, info = self._engine, self.info
        assert engine is not None and info is not None
        match msg:
            case Generate(prompt_tokens=tokens):
                assert stream is not None
                if self._aborting is not None:
                    raise ServerShuttingDown(self._aborting)
                if not tokens or not all(0 <= t < info.vocab_size for t in tokens):
                    raise InvalidRequest(f"the prompt is empty or has token ids outside [0, {info.vocab_size})",
                                         param="prompt")
                self._streams[stream.id] = stream
                engine.tell(AddRow(stream.id, msg))
                return None
            case Embed(inputs=inputs):  # checked by the EmbeddingService (its tokens, the context)
                assert stream is not None
                if self._aborting is not None:
                    raise ServerShuttingDown(self._aborting)
                if not inputs or not all(inputs):
                    raise InvalidRequest("an embedding request's inputs must not be empty", param="input")
                self._streams[stream.id] = stream
                engine.tell(AddEmbedding(stream.id, inputs))
                return None
            case Describe():
                return info
            case Warmup():
                report = await asyncio.wrap_future(engine.ask(RunWarmup()))
                log.info("warm-up took %.1fs%s", report.seconds, "" if report.mtp_round_cost is None
                         else f"; an MTP round costs {report.mtp_round_cost:.2f} plain decode steps")
                return report
            case GetEngineStats():
                return await asyncio.wrap_future(engine.ask(ReadStats()))
            case FreeSnapshots(handles=handles, release_memory=release):
                engine.tell(FreeSnapshotHandles(handles, release))
                return None
            case SaveSnapshot():
                self._save(msg, engine)
                return None
            case LoadSnapshot():
                loaded = engine.ask(ReadSnapshot(msg))
                self.start_task(lambda: self._reply_to_store(loaded, lambda exc: SnapshotLoaded(
                    msg.key, error="io", detail=f"{type(exc).__name__}: {exc}")))
                return None
            case FreeFeatures(content_hashes=hashes):
                engine.tell(FreeFeatureHashes(hashes))
                return None
            case Asked(host=False):
                return await asyncio.wrap_future(engine.ask(msg))
            case AbortAll(reason=reason):
                self._aborting = reason
                ended = list(self._streams.items())
                self._streams.clear()
                for sid, open_stream in ended:
                    open_stream.fail(ServerShuttingDown(reason))
                    engine.tell(CancelRow(sid))
                return len(ended)
        raise TypeError(type(msg).__name__)

    # -- the prefix cache's disk tier --------------------------------------------------------------
    def _save(self, msg: SaveSnapshot, engine: EngineHandle) -> None:
        """The engine copies the snapshot out now (in order with the store's frees) and writes it;
        past the queue bound, drop it."""
        if self._write_pending and self._write_pending + msg.nbytes > self.config.prefix_cache_disk_queue_bytes:
            if msg.free_after:
                engine.tell(FreeSnapshotHandles([msg.handle]))
            # told from a task: this mailbox never waits on the store's (which may be waiting on this one)
            self.start_task(lambda: self._to_store(SnapshotSaved(msg.key, error="busy")))
            return
        saved = engine.ask(WriteSnapshot(msg))
        self._write_pending += msg.nbytes

        async def written() -> None:
            try:
                await self._reply_to_store(saved, lambda exc: SnapshotSaved(
                    msg.key, error="io", detail=f"{type(exc).__name__}: {exc}"))
            finally:
                self._write_pending -= msg.nbytes

        self.start_task(written)

    async def _reply_to_store(self, outcome: Future[SnapshotSaved] | Future[SnapshotLoaded],
                              failed: Callable[[Exception], SnapshotSaved | SnapshotLoaded]) -> None:
        """The engine's outcome to the store; if the engine could not answer (it died), `failed`."""
        try:
            result = await asyncio.wrap_future(outcome)
        except Exception as exc:
            result = failed(exc)
        await self._to_store(result)

    async def _to_store(self, msg: SnapshotSaved | SnapshotLoaded) -> None:
        store = self.peers.prefix_store
        if store is None:
            return
        try:
            await store.tell(msg)
        except RuntimeFault:  # the store is stopping (shutdown): nothing is waiting for this
            log.debug("prefix store gone; %s dropped", type(msg).__name__)

    def _engine_died(self, ref: ActorRef, reason: str) -> None:
        """On the event loop: the engine will answer nothing more; every stream ends with an error
        (the client's message names no internals; the log has the reason), then the actor crashes."""
        log.error("the engine died: %s", reason)
        ended = list(self._streams.values())
        self._streams.clear()
        for stream in ended:
            stream.fail(GenerationFailed("the engine stopped before this request finished; it was not completed"))
        ref.crash(reason)

    def on_cancel(self, stream: ReplyStream) -> None:
        if self._streams.pop(stream.id, None) is not None and self._engine is not None:
            self._engine.tell(CancelRow(stream.id))

    def _deliver(self, out: StepOutput) -> None:
        """On the event loop: one step's results to their streams and their owners."""
        for sid, event in out.events:
            stream = self._streams.get(sid)
            if stream is None:
                continue
            if isinstance(event, TokenDelta):
                stream.send(event)
            elif isinstance(event, Finished | EmbeddedVectors):  # a stream's last item
                stream.send(event)
                stream.close()
                del self._streams[sid]
            else:
                stream.fail(event)
                del self._streams[sid]
        peers = self.peers
        for snap in out.snapshots:  # a snapshot nobody can take is freed at once
            if peers.prefix_store is None or not peers.prefix_store.tell_nowait(snap):
                self._tell(FreeSnapshotHandles([snap.handle]))
        for features in out.features:
            if peers.vision is None or not peers.vision.tell_nowait(features):
                self._tell(FreeFeatureHashes([h for h, _ in features.features]))
        for outcome in out.scored:
            if peers.scorer is not None and not peers.scorer.tell_nowait(outcome):
                log.warning("the SpecPrefill outcome of %s was not counted (the scorer is busy)", outcome.request_id)
        for mtp in out.mtp:
            if peers.text is not None:
                peers.text.tell_nowait(mtp)

    def _tell(self, command: FreeSnapshotHandles | FreeFeatureHashes) -> None:
        if self._engine is not None:
            self._engine.tell(command)

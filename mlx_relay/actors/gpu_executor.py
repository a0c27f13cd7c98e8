"""GPUExecutor: the actor that owns the device; every MLX operation runs on its one thread.

    requester --Generate (stream)--> GPUExecutor --> TokenDelta ..., Finished
    GPUExecutor --SnapshotTaken--> PrefixCacheStore --FreeSnapshots--> GPUExecutor
    PrefixCacheStore --SaveSnapshot / LoadSnapshot--> GPUExecutor --SnapshotSaved / SnapshotLoaded--> store
    GPUExecutor --FeaturesEncoded--> VisionExecutor --FreeFeatures--> GPUExecutor
    GPUExecutor --ScoringOutcome--> SpecPrefillScorer;  --MTPOutcome--> TextMTPExecutor

It executes what the policy actors decided (each `Generate` carries their plans) and reports
back what it did; it decides nothing about what is cached or how a request decodes. On the event
loop it keeps the reply stream of each request; on its `GPUThread` it loads the model (and
SpecPrefill's draft model, which scores prompts here, where it lives), warms the kernels and
steps the `EngineCore`. Each step's `StepOutput` is posted to the loop in one call and routed:
stream events to their streams, side results to the actors that own them (references given at
construction). A cancelled stream removes its row at the next step boundary. If the thread
dies, the actor crashes and its supervisor restarts it (reloading the model); the requests it
held get an error, new ones are served by the fresh instance.

The prefix cache's disk tier (the store decides, this actor executes): a snapshot to write is
copied to host bytes on the GPU thread, between steps (one copy of arrays already evaluated),
and written by a writer thread, one file at a time; host copies waiting for the disk are bounded
(`EngineConfig.prefix_cache_disk_queue_bytes`), past that a write is dropped and reported, never
waited for. A file to load is checked and checksummed by a reader thread (which also brings it
into the page cache), then loaded by MLX on the GPU thread (one copy from memory), each tensor
checked against the model's cache layout (probed at start, when the disk tier is on). A file
that fails any check is reported, never loaded into a request and never a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec

from mlx_relay.cache.snapshot_files import (
    SnapshotFileError,
    SnapshotIdentity,
    library_versions,
    model_fingerprint,
    verify,
    write_atomic,
)
from mlx_relay.config import EngineConfig, SpecPrefillConfig
from mlx_relay.engine.core import EngineCore, StepOutput
from mlx_relay.engine.gpu_thread import GPUThread
from mlx_relay.engine.loader import LoadedModel, apply_memory_limits, default_prefix_cache_bytes, load_model
from mlx_relay.errors import InvalidRequest, ServerShuttingDown
from mlx_relay.messages.gpu import (
    AbortAll,
    Describe,
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
    accepts = (Generate, Describe, Warmup, GetEngineStats, FreeSnapshots, FreeFeatures, AbortAll, SaveSnapshot,
               LoadSnapshot)
    mailbox_capacity = 1024

    def __init__(self, config: EngineConfig, specprefill: SpecPrefillConfig, peers: GPUPeers,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.specprefill = specprefill
        self.peers = peers
        self._on_progress = on_progress or (lambda _msg: None)
        self._streams: dict[int, ReplyStream] = {}
        self._thread: GPUThread | None = None
        self._core: EngineCore | None = None
        self._aborting: str | None = None  # the drain's deadline passed: every generation ends
        self.info: ModelInfo | None = None
        self._write_pending = 0  # bytes of snapshot copies waiting for the disk
        self._writer: anyio.CapacityLimiter | None = None  # one file written at a time
        self._reader: anyio.CapacityLimiter | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def on_start(self) -> None:
        loop = asyncio.get_running_loop()
        ref = self.ref

        def on_fatal(exc: BaseException) -> None:
            loop.call_soon_threadsafe(ref.crash, f"GPU thread died: {type(exc).__name__}: {exc}")

        def on_output(out: StepOutput) -> None:
            loop.call_soon_threadsafe(self._deliver, out)

        thread = self._thread = GPUThread("mlx-gpu", on_fatal, on_output)
        thread.start()
        await asyncio.wrap_future(thread.submit(apply_memory_limits, self.config))
        self._on_progress(f"loading {self.config.model_path}")
        loaded: LoadedModel = await asyncio.wrap_future(thread.submit(load_model, Path(self.config.model_path)))
        budget = 0
        if self.config.prefix_cache:
            budget = self.config.prefix_cache_bytes
            if budget is None:
                budget = await asyncio.wrap_future(thread.submit(default_prefix_cache_bytes))
        draft = self.specprefill.draft_model
        if draft is not None:
            self._on_progress(f"loading the SpecPrefill draft {draft}")
        self._core = await asyncio.wrap_future(thread.submit(
            lambda: EngineCore(loaded, self.config, prefix_cache=budget > 0, draft_model=draft)))
        context = loaded.info.context_length
        if self.config.max_model_len is not None:
            context = min(context, self.config.max_model_len)
        identity = None
        if self.config.prefix_cache_dir is not None and budget > 0:
            identity = await self._snapshot_identity(thread, self._core, Path(loaded.info.model_path))
        self.info = msgspec.structs.replace(loaded.info, prefix_cache_bytes=budget, context_length=context,
                                            draft=self._core.draft, snapshot_identity=identity)
        thread.stepper = self._core
        self._on_progress(f"loaded in {loaded.info.load_seconds:.1f}s")

    async def _snapshot_identity(self, thread: GPUThread, core: EngineCore, model: Path) -> SnapshotIdentity:
        """What this model's snapshot files are (and must be): its fingerprint, the caches' dtype
        (from the layout probe), the library versions."""
        self._writer, self._reader = anyio.CapacityLimiter(1), anyio.CapacityLimiter(2)
        layout = await asyncio.wrap_future(thread.submit(core.snapshot_layout))
        fingerprint = await anyio.to_thread.run_sync(model_fingerprint, model)
        mlx_version, vlm_version = library_versions()
        return SnapshotIdentity(fingerprint, layout.dtype, mlx_version, vlm_version)

    async def on_stop(self) -> None:
        thread, core = self._thread, self._core
        self._thread = self._core = None
        if thread is None:
            return
        if core is not None:
            try:
                self._deliver(await asyncio.wrap_future(thread.submit(core.close)))
            except Exception:
                log.exception("engine close failed")
        await asyncio.to_thread(thread.stop, 30.0)
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    # -- messages ----------------------------------------------------------------------------------
    async def receive(self, msg: object, stream: ReplyStream | None) -> object:
        thread, core, info = self._thread, self._core, self.info
        assert thread is not None and core is not None and info is not None
        match msg:
            case Generate(prompt_tokens=tokens):
                assert stream is not None
                if self._aborting is not None:
                    raise ServerShuttingDown(self._aborting)
                if not tokens or not all(0 <= t < info.vocab_size for t in tokens):
                    raise InvalidRequest(f"the prompt is empty or has token ids outside [0, {info.vocab_size})",
                                         param="prompt")
                self._streams[stream.id] = stream
                thread.submit(core.add, stream.id, msg)
                return None
            case Describe():
                return info
            case Warmup():
                report = await asyncio.wrap_future(thread.submit(core.warmup))
                log.info("warm-up took %.1fs%s", report.seconds, "" if report.mtp_round_cost is None
                         else f"; an MTP round costs {report.mtp_round_cost:.2f} plain decode steps")
                return report
            case GetEngineStats():
                return await asyncio.wrap_future(thread.submit(core.stats))
            case FreeSnapshots(handles=handles, release_memory=release):
                thread.submit(core.free_snapshots, handles, release)
                return None
            case SaveSnapshot():
                self._save(msg, thread, core)
                return None
            case LoadSnapshot():
                self.start_task(lambda: self._load(msg, thread, core))
                return None
            case FreeFeatures(content_hashes=hashes):
                thread.submit(core.free_features, hashes)
                return None
            case AbortAll(reason=reason):
                self._aborting = reason
                ended = list(self._streams.items())
                self._streams.clear()
                for sid, open_stream in ended:
                    open_stream.fail(ServerShuttingDown(reason))
                    thread.submit(core.cancel, sid)
                return len(ended)
        raise TypeError(type(msg).__name__)

    # -- the prefix cache's disk tier --------------------------------------------------------------
    def _save(self, msg: SaveSnapshot, thread: GPUThread, core: EngineCore) -> None:
        """Copy the snapshot out on the GPU thread now (in order with the store's frees), write
        it off the loop; past the queue bound, drop it."""
        if self._write_pending and self._write_pending + msg.nbytes > self.config.prefix_cache_disk_queue_bytes:
            if msg.free_after:
                thread.submit(core.free_snapshots, [msg.handle])
            # told from a task: this mailbox never waits on the store's (which may be waiting on this one)
            self.start_task(lambda: self._to_store(SnapshotSaved(msg.key, error="busy")))
            return
        copied = thread.submit(core.encode_snapshot, msg.handle, msg.metadata, msg.free_after)
        self._write_pending += msg.nbytes
        self.start_task(lambda: self._write(msg, copied))

    async def _write(self, msg: SaveSnapshot, copied: Future[tuple[memoryview, float]]) -> None:
        try:
            data, copy_seconds = await asyncio.wrap_future(copied)
            tic = time.perf_counter()
            name, size = await anyio.to_thread.run_sync(write_atomic, Path(msg.directory), msg.key, data,
                                                        limiter=self._writer)
            result = SnapshotSaved(msg.key, name, size, copy_seconds=copy_seconds,
                                   write_seconds=time.perf_counter() - tic)
        except KeyError:
            result = SnapshotSaved(msg.key, error="gone")
        except Exception as exc:  # a full disk, a copy MLX refused: reported, never a crash
            log.warning("prefix snapshot not written: %s: %s", type(exc).__name__, exc)
            result = SnapshotSaved(msg.key, error="io", detail=f"{type(exc).__name__}: {exc}")
        finally:
            self._write_pending -= msg.nbytes
        await self._to_store(result)

    async def _load(self, msg: LoadSnapshot, thread: GPUThread, core: EngineCore) -> None:
        tic = time.perf_counter()
        try:
            await anyio.to_thread.run_sync(verify, Path(msg.path), msg.identity, msg.length, limiter=self._reader)
            handle, nbytes = await asyncio.wrap_future(thread.submit(core.load_snapshot, msg.path, msg.length))
            result = SnapshotLoaded(msg.key, handle, nbytes, seconds=time.perf_counter() - tic)
        except SnapshotFileError as exc:
            log.warning("prefix snapshot %s not used (%s): %s", msg.path, exc.reason, exc)
            result = SnapshotLoaded(msg.key, error=exc.reason, detail=str(exc), seconds=time.perf_counter() - tic)
        except OSError as exc:
            log.warning("prefix snapshot %s could not be read: %s", msg.path, exc)
            result = SnapshotLoaded(msg.key, error="io", detail=str(exc), seconds=time.perf_counter() - tic)
        except Exception as exc:  # whatever else MLX says about a file's contents: not used, not a crash
            log.warning("prefix snapshot %s not used: %s: %s", msg.path, type(exc).__name__, exc)
            result = SnapshotLoaded(msg.key, error="corrupt", detail=f"{type(exc).__name__}: {exc}",
                                    seconds=time.perf_counter() - tic)
        await self._to_store(result)

    async def _to_store(self, msg: SnapshotSaved | SnapshotLoaded) -> None:
        store = self.peers.prefix_store
        if store is None:
            return
        try:
            await store.tell(msg)
        except RuntimeFault:  # the store is stopping (shutdown): nothing is waiting for this
            log.debug("prefix store gone; %s dropped", type(msg).__name__)

    def on_cancel(self, stream: ReplyStream) -> None:
        if self._streams.pop(stream.id, None) is not None and self._thread and self._core:
            self._thread.submit(self._core.cancel, stream.id)

    def _deliver(self, out: StepOutput) -> None:
        """On the event loop: one step's results to their streams and their owners."""
        for sid, event in out.events:
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
        peers = self.peers
        for snap in out.snapshots:  # a snapshot nobody can take is freed at once
            if peers.prefix_store is None or not peers.prefix_store.tell_nowait(snap):
                self._free(lambda core, h=snap.handle: core.free_snapshots([h]))
        for features in out.features:
            if peers.vision is None or not peers.vision.tell_nowait(features):
                self._free(lambda core, f=features: core.free_features([h for h, _ in f.features]))
        for outcome in out.scored:
            if peers.scorer is not None and not peers.scorer.tell_nowait(outcome):
                log.warning("the SpecPrefill outcome of %s was not counted (the scorer is busy)", outcome.request_id)
        for mtp in out.mtp:
            if peers.text is not None:
                peers.text.tell_nowait(mtp)

    def _free(self, fn: Callable[[EngineCore], object]) -> None:
        if self._thread is not None and self._core is not None:
            core = self._core
            self._thread.submit(fn, core)

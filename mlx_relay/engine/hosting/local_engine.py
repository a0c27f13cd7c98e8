"""The engine on a GPUThread of the calling process: an `EngineHandle` (`handle.py`).

    GPUExecutor (thread mode) --> LocalEngine --> GPUThread --> EngineCore
    process_main (the engine process) --> LocalEngine --> GPUThread --> EngineCore

Every command of the protocol (`protocol.py`) runs on the GPU thread, between steps, as
`EngineCore.apply(command)` (or its pipeline leader's); the few marked `host` run here: the boot
(memory limits, the model, SpecPrefill's draft, the EngineCore, the snapshot identity) and the
disk tier's writes and reads around the core's copy and load. The prefix
cache's disk tier runs here too, so that the engine process writes and reads its files itself: a
snapshot to write is copied to host bytes on the GPU thread and written by a writer thread, one
file at a time; a file to load is checked and checksummed by a reader thread (two at a time,
which also brings it into the page cache), then loaded by MLX on the GPU thread. Each outcome,
failures included, is the store's message (`SnapshotSaved` / `SnapshotLoaded`), never a raise.

As rank 0 of a pipeline it also watches the other ranks (`pipeline_watch.FollowerWatch`). When one
dies, the GPU thread may be inside a collective that never returns: the engine abandons the thread
(every command waiting on it fails at once), reports its death (`on_fatal`: the GPUExecutor ends
every stream with an error and the server fails), and its stop no longer waits for the thread.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from mlx_relay.cache.snapshot_files import (
    SnapshotFileError,
    SnapshotIdentity,
    library_versions,
    model_fingerprint,
    verify,
    write_atomic,
)
from mlx_relay.engine.hosting.gpu_thread import GPUThread, GPUThreadDied
from mlx_relay.engine.hosting.handle import EngineCallbacks
from mlx_relay.engine.hosting.pipeline_boot import lead_group, load_stage
from mlx_relay.engine.hosting.pipeline_sync import PipelineLeader
from mlx_relay.engine.hosting.pipeline_watch import FollowerWatch
from mlx_relay.engine.models.loader import add_copies, apply_memory_limits, load_model, prefix_cache_budget
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.protocol import (
    Asked,
    BootEngine,
    CopySnapshotOut,
    LoadSnapshotFile,
    R,
    ReadSnapshot,
    Told,
    WriteSnapshot,
)
from mlx_relay.engine.step.core import EngineCore
from mlx_relay.errors import PipelineRankLost
from mlx_relay.messages.gpu import ModelInfo
from mlx_relay.messages.prefix_cache import LoadSnapshot, SaveSnapshot, SnapshotLoaded, SnapshotSaved

log = logging.getLogger(__name__)

class LocalEngine:
    def __init__(self, callbacks: EngineCallbacks, name: str = "mlx-gpu") -> None:
        self._callbacks = callbacks
        self._thread = GPUThread(name, self._died, callbacks.on_output)
        # built by the boot, on the GPU thread; with a pipeline, rank 0's core behind its leader
        self._core: EngineCore | PipelineLeader | None = None
        self._watch: FollowerWatch | None = None  # rank 0 of a pipeline: the followers' liveness
        self._lost: str | None = None  # a follower died: the GPU thread is abandoned
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="snapshot-writer")  # one file at a time
        self._readers = ThreadPoolExecutor(2, thread_name_prefix="snapshot-reader")

    def _died(self, exc: BaseException) -> None:
        self._callbacks.on_fatal(f"GPU thread died: {type(exc).__name__}: {exc}")

    def _follower_lost(self, reason: str) -> None:
        """On the watch's thread: a pipeline rank died; the GPU thread may never return."""
        if self._lost is not None:
            return
        self._lost = reason
        log.error("%s: the engine fails (rank 0 cannot go on without it)", reason)
        self._thread.abandon(PipelineRankLost(reason))
        self._callbacks.on_fatal(reason)

    def _apply(self, command: Told | Asked[R]) -> Future[Any]:
        return self._thread.submit(lambda: self._booted().apply(command))

    def _booted(self) -> EngineCore | PipelineLeader:
        if self._core is None:
            raise RuntimeError("the engine has not booted")
        return self._core

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return None  # this process

    def start(self) -> None:
        self._thread.start()

    # -- commands --------------------------------------------------------------------------------
    def tell(self, command: Told) -> None:
        self._apply(command)

    def ask(self, command: Asked[R]) -> Future[R]:
        if isinstance(command, BootEngine):
            return self._thread.submit(self._boot, command)  # type: ignore[return-value]
        if isinstance(command, WriteSnapshot):
            return self._save_snapshot(command.msg)  # type: ignore[return-value]
        if isinstance(command, ReadSnapshot):
            return self._load_snapshot(command.msg)  # type: ignore[return-value]
        assert not command.host, f"{type(command).__name__} is a host's command this host does not run"
        return self._apply(command)

    def _boot(self, command: BootEngine) -> ModelInfo:
        """On the GPU thread, before any other command."""
        config, progress = command.engine, self._callbacks.on_progress
        apply_memory_limits(config)
        progress(f"loading {config.model_path}")
        stage: Stage | None = None
        if config.pipeline.enabled:  # rank 0 of a pipeline (pipeline_boot.py)
            group, self._watch = lead_group(config.pipeline, self._follower_lost)
            loaded, stage = load_stage(Path(config.model_path), config.pipeline, group)
            progress(f"pipeline: layers {stage.start}..{stage.end - 1} here, of {stage.size} processes")
        else:
            loaded = load_model(Path(config.model_path))
        if copied := add_copies(loaded, config):
            progress(f"16-bit copies of the dense projections: {copied / 1e9:.2f} GB")
        budget = prefix_cache_budget(config)
        draft = command.specprefill.draft_model
        if draft is not None:
            progress(f"loading the SpecPrefill draft {draft}")
        core = EngineCore(loaded, config, prefix_cache=budget > 0, draft_model=draft, stage=stage)
        context = loaded.info.context_length
        if config.max_model_len is not None:
            context = min(context, config.max_model_len)
        identity = None
        if config.prefix_cache_dir is not None and budget > 0:
            identity = self._snapshot_identity(core, Path(loaded.info.model_path))
        kv = core.kv_budget
        info = msgspec.structs.replace(loaded.info, prefix_cache_bytes=budget, context_length=context,
                                       draft=core.draft, speculative_draft=core.speculative_draft,
                                       snapshot_identity=identity,
                                       embedding=e.info(config) if (e := core.embeddings.embedder) else None,
                                       memory_tokens=kv.memory_tokens if kv is not None else 0,
                                       memory_limit_bytes=kv.limit if kv is not None else 0)
        self._core = core if stage is None else PipelineLeader(core, stage.group)
        self._thread.stepper = self._core
        progress(f"loaded in {loaded.info.load_seconds:.1f}s")
        return info

    @staticmethod
    def _snapshot_identity(core: EngineCore, model: Path) -> SnapshotIdentity:
        """What this model's snapshot files are (and must be): its fingerprint, the caches' dtype
        (from the layout probe), the library versions."""
        layout = core.snapshot_layout()
        mlx_version, vlm_version = library_versions()
        return SnapshotIdentity(model_fingerprint(model), layout.dtype, mlx_version, vlm_version)

    def stop(self, timeout_s: float) -> None:
        """The GPU thread finishes its queued commands (snapshot copies included), then the
        writes waiting for the disk land; loads not started are dropped. A pipeline's other ranks
        are told to stop first; after one died, nothing waits for the (abandoned) GPU thread."""
        if isinstance(self._core, PipelineLeader) and self._lost is None:
            if self._watch is not None:
                self._watch.stopping()
            self._thread.submit(self._core.stop_followers)
        self._thread.stop(0.0 if self._lost is not None else timeout_s)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True, cancel_futures=True)

    # -- the prefix cache's disk tier ------------------------------------------------------------
    def _save_snapshot(self, msg: SaveSnapshot) -> Future[SnapshotSaved]:
        result: Future[SnapshotSaved] = Future()
        copied = self._apply(CopySnapshotOut(msg.handle, msg.metadata, msg.free_after))

        def copied_out(done: Future[tuple[memoryview, float]]) -> None:  # on the GPU thread
            if done.cancelled():
                result.cancel()
                return
            try:
                data, copy_seconds = done.result()
            except KeyError:
                result.set_result(SnapshotSaved(msg.key, error="gone"))
                return
            except Exception as exc:  # a copy MLX refused: reported, never a crash
                result.set_result(_write_failed(msg, exc))
                return
            try:
                self._writer.submit(_write, msg, data, copy_seconds, result)
            except RuntimeError as exc:  # the writer is shut down (stopping)
                result.set_result(_write_failed(msg, exc))

        copied.add_done_callback(copied_out)
        return result

    def _load_snapshot(self, msg: LoadSnapshot) -> Future[SnapshotLoaded]:
        result: Future[SnapshotLoaded] = Future()
        tic = time.perf_counter()

        def loaded(done: Future[tuple[int, int]]) -> None:  # on the GPU thread
            try:
                handle, nbytes = done.result()
            except BaseException as exc:
                result.set_result(_load_failed(msg, exc, tic))
            else:
                result.set_result(SnapshotLoaded(msg.key, handle, nbytes, seconds=time.perf_counter() - tic))

        def verified(done: Future[int]) -> None:  # on a reader thread
            try:
                done.result()
            except BaseException as exc:
                result.set_result(_load_failed(msg, exc, tic))
                return
            self._apply(LoadSnapshotFile(msg.path, msg.length)).add_done_callback(loaded)

        try:
            self._readers.submit(verify, Path(msg.path), msg.identity, msg.length).add_done_callback(verified)
        except RuntimeError as exc:  # the readers are shut down (stopping)
            result.set_result(_load_failed(msg, exc, tic))
        return result


def _write(msg: SaveSnapshot, data: memoryview, copy_seconds: float, result: Future[SnapshotSaved]) -> None:
    """On the writer thread."""
    tic = time.perf_counter()
    try:
        name, size = write_atomic(Path(msg.directory), msg.key, data)
    except Exception as exc:  # a full disk: reported, never a crash
        result.set_result(_write_failed(msg, exc))
    else:
        result.set_result(SnapshotSaved(msg.key, name, size, copy_seconds=copy_seconds,
                                        write_seconds=time.perf_counter() - tic))


def _write_failed(msg: SaveSnapshot, exc: BaseException) -> SnapshotSaved:
    log.warning("prefix snapshot not written: %s: %s", type(exc).__name__, exc)
    return SnapshotSaved(msg.key, error="io", detail=f"{type(exc).__name__}: {exc}")


def _load_failed(msg: LoadSnapshot, exc: BaseException, tic: float) -> SnapshotLoaded:
    """A file that fails any check is reported, never loaded into a request and never a crash."""
    seconds = time.perf_counter() - tic
    fields: dict[str, Any]
    if isinstance(exc, SnapshotFileError):
        log.warning("prefix snapshot %s not used (%s): %s", msg.path, exc.reason, exc)
        fields = {"error": exc.reason, "detail": str(exc)}
    elif isinstance(exc, OSError | GPUThreadDied | CancelledError):  # the file is kept
        log.warning("prefix snapshot %s could not be read: %s: %s", msg.path, type(exc).__name__, exc)
        fields = {"error": "io", "detail": str(exc)}
    else:  # whatever else MLX says about a file's contents: not used, not a crash
        log.warning("prefix snapshot %s not used: %s: %s", msg.path, type(exc).__name__, exc)
        fields = {"error": "corrupt", "detail": f"{type(exc).__name__}: {exc}"}
    return SnapshotLoaded(msg.key, seconds=seconds, **fields)

"""GPUExecutor: the actor that owns the device; every MLX operation runs on its one thread.

    requester --Generate (stream)--> GPUExecutor --> TokenDelta ..., Finished
    GPUExecutor --SnapshotTaken--> PrefixCacheStore --FreeSnapshots--> GPUExecutor
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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

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
from mlx_relay.messages.prefix_cache import FreeSnapshots
from mlx_relay.messages.vision import FreeFeatures
from mlx_relay.runtime import Actor, ActorRef, ReplyStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GPUPeers:
    """The actors the GPUExecutor reports to (None: that feature is off)."""

    prefix_store: ActorRef | None = None
    scorer: ActorRef | None = None
    text: ActorRef | None = None
    vision: ActorRef | None = None


class GPUExecutor(Actor):
    accepts = (Generate, Describe, Warmup, GetEngineStats, FreeSnapshots, FreeFeatures, AbortAll)
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
        self.info = msgspec.structs.replace(loaded.info, prefix_cache_bytes=budget, context_length=context,
                                            draft=self._core.draft)
        thread.stepper = self._core
        self._on_progress(f"loaded in {loaded.info.load_seconds:.1f}s")

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

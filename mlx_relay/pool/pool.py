"""ModelPool: several models behind one HTTP server, each loaded when a request names it and
unloaded to make room under a memory budget (what the app serves, `http/served.Served`).

Each model is a Relay of its own (its actors; its engine in a process of its own, so that its
memory is that process's and unloading ends it), started and stopped by a task of the pool's:

- a request holds its model in use (`use`) for its whole response; a model that is not loaded is
  loaded then, and the request waits up to `load_wait_s` (then 503 + Retry-After);
- before a load the model's reservation (`reservation.py`) is counted against the budget at once,
  so two loads never both take the same room; if it does not fit, idle unpinned models are
  unloaded least recently used first (`make_room`), and the new engine starts only once they have
  let their memory go; if it cannot fit even so, the request waits for a model to become idle or
  gets 503 at once (`contention`). One slot loads once: concurrent requests wait for the same load;
- a model unloads when asked (`POST .../unload`), to make room, after its idle TTL, or with the
  server: it stops admitting, its streams finish within `drain_timeout_s` (the rest end with the
  drain's terminal events), its prefix cache is written to its disk tier (if any) and freed.

Every decision runs on the event loop between two awaits, so none needs a lock; whoever waits,
waits for the pool's next change (`_changes`), never polls.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup

from mlx_relay.chat.output import ReplyEvent
from mlx_relay.chat.reply import ChatReply
from mlx_relay.chat.types import ChatMessage
from mlx_relay.config import ServerConfig
from mlx_relay.errors import (
    ModelLoadError,
    ModelLoadFailed,
    ModelLoading,
    ModelNotFound,
    NoRoomForModel,
    NotReady,
)
from mlx_relay.http.served import BootServed, Served, embedding_card, embedding_owner
from mlx_relay.http.types import HealthBody, LoadModelBody, ModelCard
from mlx_relay.messages.admission import AdmissionStats
from mlx_relay.pool.build import gib
from mlx_relay.pool.config import PoolConfig
from mlx_relay.pool.metrics import PoolMetrics
from mlx_relay.pool.names import ModelNames
from mlx_relay.pool.reservation import make_room
from mlx_relay.pool.room import no_room, resident, yielding
from mlx_relay.pool.slot import RESIDENT, ModelSlot, UnloadReason
from mlx_relay.pool.views import admission_total, card_of, exposition, loaded, ready_line
from mlx_relay.relay import DrainReport, Relay
from mlx_relay.service import ChatService

log = logging.getLogger(__name__)

FAILED_RETRY_S = 10  # a model whose load failed is not tried again for this long


class ModelPool:
    def __init__(self, config: PoolConfig, template: ServerConfig) -> None:
        self.config = config
        self.template = template  # the server's flags: what a model registered at run time is served with
        self.slots: dict[str, ModelSlot] = {}
        self.names = ModelNames(self.slots, config.memory_budget_bytes)  # which model a request's name means
        for model in config.models:
            self.names.add(model)
        self.metrics = PoolMetrics()
        self.state = "loading"  # loading (the pinned models) / ready / draining / failed
        self.ready, self.failed = anyio.Event(), anyio.Event()
        self.error: BaseException | None = None
        self.peak_reserved = 0  # the most the models whose engines ran reserved at once
        self.ended = 0  # streams ended at an unloading model's drain deadline
        self._changed_event = anyio.Event()
        self._tg: TaskGroup | None = None

    # -- assembly -------------------------------------------------------------------------------------
    @classmethod
    def boot(cls, pool_config: PoolConfig) -> BootServed:
        """The app's boot for this pool (`http/served.BootServed`); `config` there is the server's."""

        @asynccontextmanager
        async def start(*, config: ServerConfig, wait_ready: bool,
                        on_progress: Callable[[str], None] | None) -> AsyncIterator[Served]:
            async with cls.run(pool_config, config, on_progress) as pool:
                if wait_ready:
                    await pool.ready.wait()
                yield pool

        return start

    @classmethod
    @asynccontextmanager
    async def run(cls, config: PoolConfig, template: ServerConfig,
                  progress: Callable[[str], None] | None = None) -> AsyncIterator[ModelPool]:
        """The pool, its pinned models loading, its idle models unloading after their TTL; every
        model is stopped when the context is left."""
        pool = cls(config, template)
        async with anyio.create_task_group() as tg:
            pool._tg = tg
            tg.start_soon(pool._start, progress or (lambda m: None))
            tg.start_soon(pool._unload_idle)
            try:
                yield pool
            finally:
                tg.cancel_scope.cancel()

    async def _start(self, progress: Callable[[str], None]) -> None:
        """Load the pinned models; the pool is ready once they are (failed if one cannot load)."""
        pinned = [slot for slot in self.slots.values() if slot.model.pinned]
        try:
            for slot in pinned:
                progress(f"loading pinned model {slot.name}")
                await self._ready(slot, time.monotonic())
        except (ModelLoadFailed, ModelLoadError) as exc:
            log.error("a pinned model could not be loaded: %s", exc)
            self.error, self.state = exc, "failed"
            self.failed.set()
        else:
            self.state = "ready"
        self.ready.set()
        progress("ready")

    # -- the pool's one mutex-free change signal --------------------------------------------------------
    def _changed(self) -> None:
        self._changed_event.set()
        self._changed_event = anyio.Event()

    async def _changes(self) -> None:
        await self._changed_event.wait()

    # -- loading and unloading ---------------------------------------------------------------------------
    async def _ready(self, slot: ModelSlot, arrived: float) -> None:
        """Return once `slot` is loaded: start its load if nobody has, wait for the load under way.
        A request that `arrived` after the model was ready waits while the model yields (`room.yielding`);
        one that waited for this load is served by it."""
        while True:
            if self.state in ("draining", "failed") and self.ready.is_set():
                raise NotReady(f"the server is {self.state}")
            match slot.state:
                case "ready" if arrived <= slot.ready_since or slot.name not in yielding(self.slots, self.config):
                    return
                case "ready" | "loading" | "unloading":
                    await self._changes()
                case "unloaded" | "failed":
                    if slot.state == "failed" and time.monotonic() - slot.failed_at < FAILED_RETRY_S:
                        raise ModelLoadFailed(f"the model '{slot.name}' failed to load: {slot.error}",
                                              retry_after_s=FAILED_RETRY_S)
                    victims = make_room(slot.model.reservation.total, resident(self.slots.values(), busy_too=False),
                                        self.config.memory_budget_bytes)
                    if victims is None:
                        if self.config.contention == "fail":
                            raise NoRoomForModel(no_room(slot, self.slots.values(), self.config.memory_budget_bytes))
                        await self._changes()
                        continue
                    self._begin_load(slot, victims)

    def _begin_load(self, slot: ModelSlot, victims: list[str]) -> None:
        waits = []
        for name in victims:
            self._unload(self.slots[name], "budget")
            waits.append(self.slots[name].unloaded)
        slot.begin_load()
        assert self._tg is not None
        self._tg.start_soon(self._run_model, slot, waits)
        self._changed()

    def _unload(self, slot: ModelSlot, reason: UnloadReason) -> None:
        """Ask a loading or loaded model to unload (it drains first); no-op otherwise."""
        if slot.state not in ("loading", "ready"):
            return
        if reason in ("budget", "idle"):
            self.metrics.evictions.labels(slot.name, reason).inc()
        if slot.state == "ready":
            slot.state = "unloading"
        slot.unload_reason = reason
        slot.stop.set()
        self._changed()

    async def _run_model(self, slot: ModelSlot, waits: list[anyio.Event]) -> None:
        """One load of `slot`, from the room it waits for to its memory let go."""
        for unloaded in waits:
            await unloaded.wait()
        slot.holding = True
        self.peak_reserved = max(self.peak_reserved, sum(s.model.reservation.total for s in self.slots.values()
                                                         if s.holding))
        name, tic = slot.name, time.monotonic()
        self.metrics.loads.labels(name).inc()
        drained: DrainReport | None = None
        try:
            async with Relay.start(config=slot.model.config, wait_ready=False, metrics=slot.metrics,
                                   on_progress=lambda m: log.debug("model %s: %s", name, m)) as relay:
                slot.relay = relay
                await relay.ready.wait()
                if relay.error is None:
                    slot.state = "unloading" if slot.stop.is_set() else "ready"
                    slot.loaded_at_unix, slot.ready_since = time.time(), time.monotonic()
                    seconds = slot.last_load_s = time.monotonic() - tic
                    self.metrics.load_seconds.labels(name).observe(seconds)
                    log.info("model %s loaded in %.1fs (reserved %s)", name, seconds,
                             gib(slot.model.reservation.total))
                    self._changed()
                    await _first(slot.stop.wait, relay.failed.wait)
                if relay.error is not None:  # its boot failed, or an actor of it could not be restarted
                    slot.error, slot.failed_at = relay.error, time.monotonic()
                    if slot.loaded_at_unix is not None:
                        slot.unload_reason = "failed"
                else:
                    slot.state = "unloading"
                    self._changed()
                    drained = await relay.drain(self.config.drain_timeout_s)
        finally:  # also when the pool is stopped: no await here
            self._after(slot, drained)

    def _after(self, slot: ModelSlot, drained: DrainReport | None) -> None:
        slot.relay, slot.holding, slot.loaded_at_unix = None, False, None
        if slot.error is not None and slot.unload_reason is None:
            slot.state = "failed"
            self.metrics.load_failures.labels(slot.name).inc()
            log.error("model %s could not be loaded: %s", slot.name, slot.error)
        else:
            reason = slot.unload_reason or ("failed" if slot.error is not None else "shutdown")
            slot.state = "unloaded"
            self.metrics.unloads.labels(slot.name, reason).inc()
            self.ended += drained.ended if drained is not None else 0
            ended = f", {drained.ended} streams ended at the drain's deadline" if drained and drained.ended else ""
            log.info("model %s unloaded (%s)%s", slot.name, reason, ended)
            slot.unload_reason = None
        slot.unloaded.set()
        self._changed()

    async def _unload_idle(self) -> None:
        """Unload each idle model whose TTL ran out; sleep until the next one runs out or the pool changes."""
        while True:
            now = time.monotonic()
            due = [(until, slot) for slot in self.slots.values() if (until := slot.idle_until()) is not None]
            for until, slot in due:
                if until <= now:
                    self._unload(slot, "idle")
            later = [until - now for until, _ in due if until > now]
            with anyio.move_on_after(min(later) if later else math.inf):
                await self._changes()

    # -- Served: what the app asks -------------------------------------------------------------------------
    def resolve(self, model: str | None) -> str:
        return self.names.resolve(model)

    def resolve_embedding(self, model: str | None) -> str:
        return embedding_owner(model, [m.config for m in self.config.models], self.resolve)

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ChatService]:
        slot = self.slots[name]
        slot.touch()
        arrived = slot.last_used
        slot.waiters += 1
        if slot.waiters == 1:
            slot.waiting_since = time.monotonic()
        try:
            waited = True
            with anyio.move_on_after(self.config.load_wait_s):
                await self._ready(slot, arrived)
                waited = False
        finally:
            slot.waiters -= 1
            self._changed()
        if waited:
            if slot.state in ("unloaded", "failed"):  # never got room within the wait
                raise NoRoomForModel(no_room(slot, self.slots.values(), self.config.memory_budget_bytes))
            raise ModelLoading(f"the model '{name}' is {slot.state}; it was not ready within "
                               f"{self.config.load_wait_s:g}s", retry_after_s=10)
        assert slot.relay is not None and slot.relay.service is not None
        slot.active += 1
        try:
            yield slot.relay.service
        finally:
            slot.active -= 1
            slot.touch()
            self._changed()

    # -- the in-process API ----------------------------------------------------------------------------
    async def chat(self, model: str | None, messages: Sequence[ChatMessage | dict[str, Any]],
                   **params: Any) -> ChatReply:
        """`Relay.chat` on the model `model` names (loaded first if need be, held in use meanwhile)."""
        name = self.resolve(model)
        async with self.use(name):
            return await self.relay(name).chat(messages, **params)

    async def stream_chat(self, model: str | None, messages: Sequence[ChatMessage | dict[str, Any]],
                          **params: Any) -> AsyncIterator[ReplyEvent]:
        """`Relay.stream_chat` on the model `model` names (loaded first if need be, held in use meanwhile)."""
        name = self.resolve(model)
        async with self.use(name):
            async for event in self.relay(name).stream_chat(messages, **params):
                yield event

    def relay(self, name: str | None) -> Relay:
        slot = self.slots[name if name is not None else next(iter(self.slots))]
        if slot.state != "ready" or slot.relay is None:
            raise NotReady(f"the model '{slot.name}' is {slot.state}")
        return slot.relay

    async def health(self) -> tuple[HealthBody, bool]:
        body = HealthBody(self.state, next(iter(self.slots)),  # type: ignore[arg-type]
                          models={slot.name: slot.state for slot in self.slots.values()})
        if self.error is not None:
            body.error = str(self.error)
        relays = loaded(list(self.slots.values()))
        if relays:
            body.backend = next((r.info.backend for r in relays if r.info is not None), None)
            stats = await self.admission_stats()
            body.running, body.queued = stats.running, stats.queued
            body.max_num_seqs, body.max_queue = stats.max_num_seqs, stats.max_queue
        return body, self.state == "ready"

    async def model_cards(self, created: int) -> list[ModelCard]:
        slots = list(self.slots.values())
        embeds = [card for slot in slots for card in embedding_card(slot.model.config, slot.relay, created)]
        return [*[await card_of(slot, created) for slot in slots], *embeds]

    async def admission_stats(self) -> AdmissionStats:
        return await admission_total(list(self.slots.values()), self.state)

    async def scrape(self) -> bytes:
        return await exposition(self.metrics, list(self.slots.values()), self.config.memory_budget_bytes,
                                self.peak_reserved)

    async def load(self, name: str, body: LoadModelBody) -> ModelCard:
        name = self.names.register(name, body, self.template) if body.path is not None else self.names.configured(name)
        async with self.use(name):
            pass
        return await card_of(self.slots[name], int(time.time()))

    async def unload(self, name: str) -> ModelCard:
        slot = self.slots[self.resolve(name)] if name in self.names else None
        if slot is None:
            raise ModelNotFound(f"the model '{name}' does not exist; this server serves {', '.join(self.slots)}",
                                model=name)
        if slot.state in ("loading", "ready", "unloading"):
            done = slot.unloaded
            self._unload(slot, "request")
            await done.wait()
        return await card_of(slot, int(time.time()))

    async def drain(self, timeout_s: float) -> DrainReport:
        """Every model drains and unloads (their streams finish within the pool's drain timeout)."""
        tic, ended = time.monotonic(), self.ended
        self.state = "draining"
        self._changed()
        holding = [slot for slot in self.slots.values() if slot.state in RESIDENT]
        for slot in holding:
            self._unload(slot, "shutdown")
        for slot in holding:
            await slot.unloaded.wait()
        return DrainReport(seconds=round(time.monotonic() - tic, 3), ended=self.ended - ended)

    def ready_line(self) -> str:
        return ready_line(list(self.slots.values()), self.config.memory_budget_bytes)


async def _first(*waits: Callable[[], object]) -> None:
    """Return when the first of `waits` returns."""
    async with anyio.create_task_group() as tg:
        async def run(wait: Callable[[], object]) -> None:
            await wait()  # type: ignore[misc]
            tg.cancel_scope.cancel()

        for wait in waits:
            tg.start_soon(run, wait)

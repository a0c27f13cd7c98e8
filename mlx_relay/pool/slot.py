"""One model of the pool: its state, its Relay while loaded, who is using it, when last.

    unloaded --(a request, a pinned start, POST load)--> loading --(booted)--> ready
    ready --(POST unload, idle TTL, room for another, the server's drain)--> unloading --> unloaded
    loading --(the boot failed)--> failed --(a request or POST load, after the backoff)--> loading

A ready model may be *yielding* (the pool's `_yielding`, derived, never stored): the model that
has waited longest for room needs it unloaded and has waited as long as its own last load took, so
it admits no request that arrived after it became ready (those that waited for its load are served
by it); its running ones finish, it becomes idle and is unloaded, and the requests held back wait
for their turn.

Only the pool (`pool.py`) changes a slot, on the event loop; a slot holds no lock.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

import anyio

from mlx_relay.metrics import ServerMetrics
from mlx_relay.pool.config import PooledModel

if TYPE_CHECKING:
    from mlx_relay.relay import Relay

ModelState = Literal["unloaded", "loading", "ready", "unloading", "failed"]
UnloadReason = Literal["request", "budget", "idle", "failed", "shutdown"]

#: states in which a model holds (or is about to hold) its reservation
RESIDENT: frozenset[ModelState] = frozenset({"loading", "ready", "unloading"})


class ModelSlot:
    def __init__(self, model: PooledModel) -> None:
        self.model = model
        self.metrics = ServerMetrics(model.name)  # its request-path series, kept across loads
        self.state: ModelState = "unloaded"
        self.relay: Relay | None = None  # while loading (once its actors run) and loaded
        self.active = 0  # requests holding its chat service (their responses under way)
        self.waiters = 0  # requests waiting for it to be ready
        self.waiting_since = 0.0  # monotonic: when its waiters began (while there are any)
        self.last_used = 0.0  # monotonic; 0: never
        self.last_used_unix: float | None = None
        self.loaded_at_unix: float | None = None
        self.ready_since = 0.0  # monotonic: when its current load became ready
        self.last_load_s = 0.0  # how long its last load took (0: never loaded)
        self.holding = False  # its engine is started (its memory is taken), until it is unloaded
        self.error: BaseException | None = None  # why its last load failed
        self.failed_at = 0.0
        self.unload_reason: UnloadReason | None = None
        self.stop = anyio.Event()  # set: unload it
        self.unloaded = anyio.Event()  # set once it has let its memory go (a new one per load)

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def reserved(self) -> int:
        """Bytes counted against the budget now."""
        return self.model.reservation.total if self.state in RESIDENT else 0

    def touch(self) -> None:
        self.last_used, self.last_used_unix = time.monotonic(), time.time()

    def evictable(self) -> bool:
        return self.state == "ready" and not self.model.pinned and self.active == 0

    def idle_until(self) -> float | None:
        """When its idle TTL runs out (monotonic), if it has one and is idle now."""
        ttl = self.model.idle_ttl_s
        if ttl is None or not self.evictable():
            return None
        return self.last_used + ttl

    def begin_load(self) -> None:
        self.state, self.error, self.unload_reason = "loading", None, None
        self.stop, self.unloaded = anyio.Event(), anyio.Event()

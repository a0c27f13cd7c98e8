"""Who makes room for whom among the pool's models (no MLX; the model pool's, `pool.py`): the
models holding memory as `reservation.make_room` sees them, the ready models that stop admitting
requests so that a model waiting for room gets its turn, and what a request that finds no room is told.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from mlx_relay.pool.build import gib
from mlx_relay.pool.config import PoolConfig
from mlx_relay.pool.reservation import Resident, make_room
from mlx_relay.pool.slot import RESIDENT, ModelSlot


def resident(slots: Iterable[ModelSlot], *, busy_too: bool) -> list[Resident]:
    """The models holding memory: evictable when ready and unpinned, and idle unless `busy_too`
    (which the fairness rule asks: whom to stop admitting to)."""
    return [Resident(s.name, s.reserved, s.evictable() or (busy_too and s.state == "ready" and not s.model.pinned),
                     s.last_used) for s in slots if s.state in RESIDENT]


def yielding(slots: dict[str, ModelSlot], config: PoolConfig) -> list[str]:
    """The ready models that admit no new request now: those to be unloaded for the model that
    has waited longest for room (their running requests finish first), once it has waited, and
    they have served since they became ready, as long as its last load took (so a swap is
    followed by at least about as much serving as it cost; a model never loaded is owed its
    turn at once). No model's requests wait for ever behind a steady stream to another.
    Empty where nobody waits for room."""
    budget = config.memory_budget_bytes
    waiting = [s for s in slots.values() if s.waiters and s.state in ("unloaded", "failed")]
    if budget is None or not waiting or config.contention == "fail":
        return []
    first = min(waiting, key=lambda s: s.waiting_since)
    victims = make_room(first.model.reservation.total, resident(slots.values(), busy_too=True), budget) or []
    since = max([first.waiting_since, *(slots[name].ready_since for name in victims)])
    return victims if time.monotonic() - since >= first.last_load_s else []


def no_room(slot: ModelSlot, slots: Iterable[ModelSlot], budget: int | None) -> str:
    """Why `slot`'s model cannot load now: its size, the budget and the models in use."""
    busy = ", ".join(f"{s.name} ({s.state}{', pinned' if s.model.pinned else ''}, {s.active} requests)"
                     for s in slots if s.state in RESIDENT)
    return (f"the model '{slot.name}' ({gib(slot.model.reservation.total)}) does not fit the memory budget "
            f"({gib(budget or 0)}) beside the models in use: {busy}; retry")

"""What the pool shows of its models (read-only views over its slots, `slot.py`): a model's card
for `/v1/models`, every loaded model's admission counts summed for `/health` and `/v1/loads`, and
the one `/metrics` exposition of every model's series beside the pool's own (`metrics.py`), and
the line it logs once ready."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from prometheus_client import generate_latest

from mlx_relay.errors import NotReady
from mlx_relay.http.served import model_card
from mlx_relay.http.types import ModelMemory, PooledModelCard
from mlx_relay.messages.admission import REJECT_REASONS, AdmissionStats
from mlx_relay.metrics.server import MergedCollector
from mlx_relay.pool.build import gib
from mlx_relay.pool.metrics import PoolMetrics
from mlx_relay.pool.slot import ModelSlot
from mlx_relay.relay import Relay
from mlx_relay.runtime import RuntimeFault


def loaded(slots: Sequence[ModelSlot]) -> list[Relay]:
    """The Relays of the models that are ready."""
    return [slot.relay for slot in slots if slot.state == "ready" and slot.relay is not None]


async def card_of(slot: ModelSlot, created: int) -> PooledModelCard:
    """A model's card: what it reserves, and while loaded its context, capabilities and MLX's memory."""
    r = slot.model.reservation
    memory = ModelMemory(r.total, r.weights_bytes, r.prefix_cache_bytes, r.decode_bytes, r.buffer_cache_bytes)
    base = model_card(slot.relay, created) if slot.relay is not None else None
    if slot.state == "ready" and slot.relay is not None:
        try:
            engine = await slot.relay.engine_stats()
            memory = msgspec.structs.replace(memory, active_bytes=engine.active_memory_bytes,
                                             peak_bytes=engine.peak_memory_bytes)
        except (NotReady, RuntimeFault):
            pass
    ctx = base.context_length if base is not None and base.context_length else slot.model.context_length
    return PooledModelCard(
        slot.name, created, context_length=ctx, max_model_len=ctx,
        capabilities=base.capabilities if base is not None else None,
        state=slot.state, pinned=slot.model.pinned, aliases=list(slot.model.config.model_aliases),
        memory=memory, running=slot.active, waiting=slot.waiters, idle_ttl_s=slot.model.idle_ttl_s,
        last_used=slot.last_used_unix, loaded_at=slot.loaded_at_unix,
        error=None if slot.error is None else str(slot.error))


async def admission_total(slots: Sequence[ModelSlot], state: str) -> AdmissionStats:
    """Every loaded model's admission counts, summed (a model whose Admission is restarting left out)."""
    total = AdmissionStats(state=state, detail="", running=0, queued=0, max_num_seqs=0, max_queue=0,  # type: ignore[arg-type]
                           admitted=0, rejected=dict.fromkeys(REJECT_REASONS, 0))
    for relay in loaded(slots):
        try:
            s = await relay.stats()
        except RuntimeFault:
            continue
        total = msgspec.structs.replace(
            total, running=total.running + s.running, queued=total.queued + s.queued,
            max_num_seqs=total.max_num_seqs + s.max_num_seqs, max_queue=total.max_queue + s.max_queue,
            admitted=total.admitted + s.admitted,
            rejected={k: total.rejected.get(k, 0) + v for k, v in s.rejected.items()})
    return total


async def exposition(metrics: PoolMetrics, slots: Sequence[ModelSlot], budget: int | None, peak: int) -> bytes:
    """The pool's series and every model's (a loaded model's actors asked now), one family per name."""
    collectors = [metrics.collector(slots, budget, peak)]
    for slot in slots:
        snapshot = None
        if slot.state == "ready" and slot.relay is not None:
            try:
                snapshot = await slot.relay.stats_snapshot()
            except RuntimeFault:
                pass
        collectors.append(slot.metrics.collector(snapshot))
    return generate_latest(MergedCollector(collectors))


def ready_line(slots: list[ModelSlot], budget: int | None) -> str:
    """The pool's line when it is ready: its models, the pinned ones, its memory budget."""
    pinned = [s.name for s in slots if s.model.pinned]
    return (f"{len(slots)} models ({', '.join(s.name for s in slots)}; pinned: {', '.join(pinned) or 'none'}), "
            f"memory budget {gib(budget) if budget is not None else 'none'}")

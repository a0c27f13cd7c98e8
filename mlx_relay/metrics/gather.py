"""One scrape's snapshot of the actors' stats (`StatsSnapshot`), asked through each actor's own
stats message. An actor that does not answer (restarting, stopped, or slower than `timeout_s`:
the GPU thread answers between steps) leaves its part out of this scrape instead of failing it.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from mlx_relay.messages.admission import GetStats
from mlx_relay.messages.gpu import GetEngineStats
from mlx_relay.messages.prefix_cache import GetPrefixStats
from mlx_relay.messages.specprefill import GetSpecPrefillStats
from mlx_relay.messages.text_mtp import GetMTPStats
from mlx_relay.messages.vision import GetVisionStats
from mlx_relay.metrics.stats import StatsSnapshot
from mlx_relay.runtime import ActorRef, RuntimeFault
from mlx_relay.service import Actors

log = logging.getLogger(__name__)


async def gather_stats(status: str, admission: ActorRef, actors: Actors | None,
                       timeout_s: float = 5.0) -> StatsSnapshot:
    """`actors`: None while the model loads (only Admission answers then)."""

    async def ask(ref: ActorRef | None, msg: msgspec.Struct) -> Any:
        if ref is None:
            return None
        try:
            return await ref.ask(msg, timeout=timeout_s)
        except RuntimeFault as exc:
            log.warning("metrics: %s left out of this scrape (%s)", ref.name, exc)
            return None

    stats = await admission.ask(GetStats(), timeout=timeout_s)
    if actors is None:
        return StatsSnapshot(status, stats)
    return StatsSnapshot(status, stats,
                         engine=await ask(actors.gpu, GetEngineStats()),
                         prefix=await ask(actors.prefix_store, GetPrefixStats()),
                         mtp=await ask(actors.text, GetMTPStats()),
                         vision=await ask(actors.vision, GetVisionStats()),
                         specprefill=await ask(actors.scorer, GetSpecPrefillStats()))

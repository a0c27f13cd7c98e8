"""VisionExecutor: the vision path's policy for encoded image features.

    ChatService --PlanVision--> VisionExecutor --> VisionPlan (features reused, pinned)
    GPUExecutor --FeaturesEncoded--> VisionExecutor: features now held on the GPU thread
    VisionExecutor --FreeFeatures--> GPUExecutor: evicted
    ChatService --ReleaseVision--> VisionExecutor: the request is over (unpinned)

Requests with images or video take the vision path (the MediaRouter said so). Each image's
features are keyed by its content hash, so a repeated image (the same screenshot in every turn
of a conversation) is never encoded again, even next to new images. This actor owns the index:
which features are held, their bytes against `vision_cache_bytes`, least-recently-used eviction
of the unpinned ones, hits and misses. The arrays stay on the GPU thread (`engine/memory/features.py`),
which encodes what it does not hold and reports it here.
"""

from __future__ import annotations

from collections import OrderedDict

from mlx_relay.config import EngineConfig
from mlx_relay.messages.vision import (
    FeaturesEncoded,
    FreeFeatures,
    GetVisionStats,
    PlanVision,
    ReleaseVision,
    VisionPlan,
    VisionStats,
)
from mlx_relay.runtime import Actor, ActorRef, ReplyStream


class VisionExecutor(Actor):
    accepts = (PlanVision, FeaturesEncoded, ReleaseVision, GetVisionStats)
    mailbox_capacity = 4096

    def __init__(self, config: EngineConfig, gpu: ActorRef) -> None:
        self.budget = config.vision_cache_bytes
        self.gpu = gpu
        self._held: OrderedDict[str, int] = OrderedDict()  # content hash -> bytes, least recent first
        self._pins: dict[str, int] = {}  # content hash -> requests using it
        self._by_request: dict[str, list[str]] = {}
        self._bytes = 0
        self.hits = self.misses = self.evictions = 0

    async def receive(self, msg: PlanVision | FeaturesEncoded | ReleaseVision | GetVisionStats,
                      stream: ReplyStream | None) -> object:
        match msg:
            case PlanVision():
                return self._plan(msg)
            case FeaturesEncoded():
                await self._held_now(msg)
                return None
            case ReleaseVision(request_id=rid):
                for h in self._by_request.pop(rid, []):
                    self._pins[h] -= 1
                    if not self._pins[h]:
                        del self._pins[h]
                await self._evict()
                return None
            case GetVisionStats():
                return VisionStats(self.hits, self.misses, self.evictions, len(self._held), self._bytes, self.budget)
        raise TypeError(type(msg).__name__)

    def _plan(self, msg: PlanVision) -> VisionPlan:
        reuse = []
        for h in msg.content_hashes:
            if h in self._held:
                self._held.move_to_end(h)
                reuse.append(h)
                self.hits += 1
            else:
                self.misses += 1
        pinned = sorted(set(reuse))
        for h in pinned:
            self._pins[h] = self._pins.get(h, 0) + 1
        self._by_request.setdefault(msg.request_id, []).extend(pinned)
        return VisionPlan(reuse)

    async def _held_now(self, msg: FeaturesEncoded) -> None:
        for h, nbytes in msg.features:
            if h in self._held:  # encoded twice (two requests at once): the GPU holds one copy
                continue
            self._held[h] = nbytes
            self._bytes += nbytes
        await self._evict()

    async def _evict(self) -> None:
        evicted = []
        for h in list(self._held):
            if self._bytes <= self.budget:
                break
            if h in self._pins:
                continue
            self._bytes -= self._held.pop(h)
            evicted.append(h)
        if evicted:
            self.evictions += len(evicted)
            await self.gpu.tell(FreeFeatures(evicted))

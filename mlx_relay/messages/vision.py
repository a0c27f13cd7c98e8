"""Messages of the VisionExecutor (`actors/vision_executor.py`): which images' encoded features
a vision request reuses (pinned while it runs), which the GPU executor encoded, which it frees."""

from __future__ import annotations

import msgspec


class PlanVision(msgspec.Struct, frozen=True):
    """Ask: the request's images by content hash. Reply: VisionPlan (its reused features pinned
    until ReleaseVision)."""

    request_id: str
    content_hashes: list[str]


class VisionPlan(msgspec.Struct, frozen=True):
    reuse: list[str] = []  # features the GPU executor holds (pinned): not encoded again


class ReleaseVision(msgspec.Struct, frozen=True):
    """Tell: the request is over (its pins go)."""

    request_id: str


class FeaturesEncoded(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> VisionExecutor): features now held on the GPU thread, by content hash."""

    request_id: str
    features: list[tuple[str, int]]  # (content hash, bytes)


class FreeFeatures(msgspec.Struct, frozen=True):
    """Tell (VisionExecutor -> GPUExecutor): drop these features (evicted)."""

    content_hashes: list[str]


class GetVisionStats(msgspec.Struct, frozen=True):
    """Ask. Reply: VisionStats."""


class VisionStats(msgspec.Struct, frozen=True):
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    budget_bytes: int

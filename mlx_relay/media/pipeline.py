"""One request's media, end to end, for the MediaRouter: fetch all items, then decode, preprocess
and expand the prompt in a worker thread.

`fetch_all` runs on the event loop (items are fetched concurrently; data URLs and local files in
worker threads, http(s) with httpx); `prepare_vision` is synchronous and runs in a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import numpy as np

from mlx_relay.chat.types import ImageUrlPart, MediaPart
from mlx_relay.config import MediaConfig
from mlx_relay.media.decode import decode_image, decode_video
from mlx_relay.media.errors import MediaError
from mlx_relay.media.expand import MediaSlot, expand_prompt
from mlx_relay.media.fetch import fetch_media
from mlx_relay.media.items import DecodedImage, DecodedVideo, FetchedMedia, MediaKind
from mlx_relay.media.preprocess import VisionProcessor
from mlx_relay.media.tensors import MediaTensor, VisionInputs

__all__ = ["fetch_all", "media_kinds", "prepare_vision"]


def media_kinds(parts: Sequence[MediaPart]) -> list[MediaKind]:
    return ["image" if isinstance(p, ImageUrlPart) else "video" for p in parts]


def _label(index: int, kind: MediaKind) -> str:
    return f"media item {index + 1} ({kind})"


async def fetch_all(parts: Sequence[MediaPart], config: MediaConfig) -> list[FetchedMedia]:
    """Every part's bytes, in order, fetched concurrently. The first failure cancels the other fetches
    and the error of the earliest failed item is raised (always a `MediaError`, a 400)."""
    kinds = media_kinds(parts)
    results: list[FetchedMedia | None] = [None] * len(parts)
    errors: dict[int, MediaError] = {}

    async def one(index: int, tg_scope: anyio.CancelScope) -> None:
        try:
            results[index] = await fetch_media(parts[index].url, kinds[index], config, _label(index, kinds[index]))
        except MediaError as exc:
            errors[index] = exc
            tg_scope.cancel()

    async with anyio.create_task_group() as tg:
        for index in range(len(parts)):
            tg.start_soon(one, index, tg.cancel_scope)
    if errors:
        raise errors[min(errors)]
    return [r for r in results if r is not None]


def prepare_vision(processor: VisionProcessor, config: MediaConfig, items: Sequence[FetchedMedia],
                   prompt_tokens: Sequence[int]) -> tuple[list[int], VisionInputs]:
    """Decode `items`, run the checkpoint's processors and expand `prompt_tokens` (worker thread)."""
    min_frames, max_frames = processor.video_frame_bounds
    decoded: list[DecodedImage | DecodedVideo] = [
        decode_image(item, config) if item.kind == "image"
        else decode_video(item, config, min_frames=min_frames, max_frames=max_frames)
        for item in items
    ]
    images = [(d, it.label) for d, it in zip(decoded, items, strict=True) if isinstance(d, DecodedImage)]
    videos = [(d, it.label) for d, it in zip(decoded, items, strict=True) if isinstance(d, DecodedVideo)]
    pixel_values = image_grid = video_values = video_grid = None
    image_slots: list[MediaSlot] = []
    video_slots: list[MediaSlot] = []
    if images:
        pixel_values, image_grid, image_slots = processor.preprocess_images(
            [d for d, _ in images], [label for _, label in images])
    if videos:
        video_values, video_grid, video_slots = processor.preprocess_videos(
            [d for d, _ in videos], [label for _, label in videos])
    image_iter, video_iter = iter(image_slots), iter(video_slots)
    slots = [next(image_iter) if item.kind == "image" else next(video_iter) for item in items]
    spans: list[tuple[int, int]] = []
    tokens = expand_prompt(prompt_tokens, slots, processor.vocab, spans)
    vision = VisionInputs(
        pixel_values=_tensor(pixel_values),
        image_grid_thw=_tensor(image_grid),
        pixel_values_videos=_tensor(video_values),
        video_grid_thw=_tensor(video_grid),
        content_hashes=tuple(d.content_hash for d in decoded),
        spans=tuple(spans),
    )
    return tokens, vision


def _tensor(array: np.ndarray | None) -> MediaTensor | None:
    return None if array is None else MediaTensor.from_numpy(array)

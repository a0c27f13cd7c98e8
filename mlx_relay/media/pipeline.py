"""One request's media, end to end, for the MediaRouter: fetch all items, then decode them and run
the model family's processor (`processor.MediaProcessor`: preprocess, expand the prompt) in a
worker thread.

`fetch_all` runs on the event loop (items are fetched concurrently; data URLs and local files in
worker threads, http(s) with httpx); `prepare_vision` is synchronous and runs in a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from mlx_relay.chat.types import ImageUrlPart, MediaPart
from mlx_relay.config import MediaConfig
from mlx_relay.media.decode import decode_image, decode_video
from mlx_relay.media.errors import MediaError
from mlx_relay.media.fetch import fetch_media
from mlx_relay.media.items import DecodedMedia, FetchedMedia, MediaKind
from mlx_relay.media.processor import MediaProcessor
from mlx_relay.media.tensors import VisionInputs

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


def prepare_vision(processor: MediaProcessor, config: MediaConfig, items: Sequence[FetchedMedia],
                   prompt_tokens: Sequence[int]) -> tuple[list[int], VisionInputs]:
    """Decode `items`, then run the model family's processor: preprocess, expand `prompt_tokens`
    (worker thread)."""
    min_frames, max_frames = processor.video_frame_bounds
    decoded: list[DecodedMedia] = [
        decode_image(item, config) if item.kind == "image"
        else decode_video(item, config, min_frames=min_frames, max_frames=max_frames)
        for item in items
    ]
    return processor.process(decoded, [item.label for item in items], prompt_tokens)

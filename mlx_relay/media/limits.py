"""The MediaRouter's resource limits (from `MediaConfig`), checked as early as each value is known.

Counts before anything is fetched, bytes while fetching (before decoding), pixels from the image
or video header before any pixel is decoded (the decompression-bomb guard).
"""

from __future__ import annotations

from collections.abc import Sequence

from mlx_relay.config import MediaConfig
from mlx_relay.media.errors import MediaTooLarge, TooManyMedia
from mlx_relay.media.items import MediaKind


def check_media_counts(kinds: Sequence[MediaKind], config: MediaConfig) -> None:
    images = sum(1 for k in kinds if k == "image")
    videos = len(kinds) - images
    if images > config.max_images_per_request:
        raise TooManyMedia(
            f"the request has {images} images; this server accepts at most {config.max_images_per_request} "
            "per request (MediaConfig.max_images_per_request)"
        )
    if videos > config.max_videos_per_request:
        raise TooManyMedia(
            f"the request has {videos} videos; this server accepts at most {config.max_videos_per_request} "
            "per request (MediaConfig.max_videos_per_request)"
        )


def check_bytes(size: int, config: MediaConfig, label: str) -> None:
    if size > config.max_media_bytes:
        raise MediaTooLarge(
            f"{label} is larger than {config.max_media_bytes} bytes (MediaConfig.max_media_bytes)"
        )


def check_pixels(width: int, height: int, config: MediaConfig, label: str) -> None:
    if width < 1 or height < 1:
        raise MediaTooLarge(f"{label} has an invalid size {width}x{height}")
    if width * height > config.max_image_pixels:
        raise MediaTooLarge(
            f"{label} is {width}x{height} pixels, more than {config.max_image_pixels} "
            "(MediaConfig.max_image_pixels)"
        )


def base64_decoded_size(encoded_chars: int) -> int:
    """An upper bound of the bytes `encoded_chars` base64 characters decode to."""
    return (encoded_chars * 3 + 3) // 4

"""Values passed between the MediaRouter's pipeline stages (fetch -> decode -> preprocess).

They live only inside one request's processing, in worker threads; they never travel in actor
messages (those carry `mlx_relay.media.tensors` bytes instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

MediaKind = Literal["image", "video"]
Source = Literal["data", "file", "http"]


@dataclass(frozen=True)
class FetchedMedia:
    """Raw bytes of one media item and where they came from."""

    kind: MediaKind
    data: bytes
    source: Source
    label: str  # "media item 2 (image)": names the item in error messages


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # (H, W, 3) uint8 RGB
    content_hash: str


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # (T, H, W, 3) uint8 RGB, the sampled frames
    frame_indices: tuple[int, ...]  # their indices in the source video
    source_fps: float
    content_hash: str


DecodedMedia = DecodedImage | DecodedVideo

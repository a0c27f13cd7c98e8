"""Numpy arrays as message payloads: what the MediaRouter hands to the vision executor.

Messages between actors carry no numpy or MLX arrays, only bytes plus shape and dtype; the
executor rebuilds arrays on its own thread (`MediaTensor.to_numpy`, then MLX there).
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np


class MediaTensor(msgspec.Struct, frozen=True):
    """A C-ordered array's raw bytes, its shape and its numpy dtype name (e.g. "float32")."""

    data: bytes
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> MediaTensor:
        contiguous = np.ascontiguousarray(array)
        return cls(data=contiguous.tobytes(), shape=tuple(int(d) for d in contiguous.shape),
                   dtype=contiguous.dtype.name)

    def to_numpy(self) -> np.ndarray:
        """A read-only view of `data` with the stored shape and dtype (no copy)."""
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class VisionInputs(msgspec.Struct, frozen=True):
    """Preprocessed pixels of one request, as the checkpoint's processor produced them.

    `layout` says how the pixels are laid out, and so how the engine turns them into prompt
    embeddings (`engine/memory/features.py`):
    - "patches" (Qwen-VL): `pixel_values` is (num_patches, C*T*P*P) and `image_grid_thw`
      (num_images, 3), the same for videos; the engine encodes each item by its grid and keeps
      its features by content hash;
    - "images" (Gemma 3): `pixel_values` is (num_images, C, H, W), every image of the
      processor's one size, no grid; the model's own embedding path encodes them.
    A kind the request does not carry is None. `content_hashes` has one entry per media item in
    message order (images and videos interleaved as they appear).
    """

    pixel_values: MediaTensor | None
    image_grid_thw: MediaTensor | None
    pixel_values_videos: MediaTensor | None
    video_grid_thw: MediaTensor | None
    content_hashes: tuple[str, ...]
    spans: tuple[tuple[int, int], ...] = ()  # each item's [start, end) in the expanded prompt
    layout: Literal["patches", "images"] = "patches"

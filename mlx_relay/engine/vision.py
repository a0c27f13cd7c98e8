"""Vision encoding for the VisionExecutor path (GPU thread only).

Turns a request's `VisionInputs` (preprocessed off the GPU by the MediaRouter, carried as bytes)
into the prompt embeddings and M-RoPE positions the batch generator needs. Each image is encoded
on its own and its features are kept in a `FeatureCache` keyed by the image's content hash, so a
repeated image (the same screenshot in every turn of a conversation) is never re-encoded, even
next to new images. Hits and misses are counted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_relay.media.tensors import MediaTensor, VisionInputs


def to_mx(t: MediaTensor) -> mx.array:
    return mx.array(np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(t.shape))


@dataclass
class FeatureCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0


class FeatureCache:
    """LRU of encoded image features by content hash, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, mx.array] = OrderedDict()
        self.stats = FeatureCacheStats()

    def get(self, key: str) -> mx.array | None:
        value = self._items.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(key)
        self.stats.hits += 1
        return value

    def put(self, key: str, value: mx.array) -> None:
        if value.nbytes > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.stats.bytes -= old.nbytes
        self._items[key] = value
        self.stats.bytes += value.nbytes
        while self.stats.bytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.stats.bytes -= evicted.nbytes
            self.stats.evictions += 1
        self.stats.entries = len(self._items)


def _encode(model: Any, pixels: mx.array, grid: mx.array, hashes: tuple[str, ...], cache: FeatureCache
            ) -> mx.array:
    """Features of every item, in order: cached ones reused, the others encoded one by one."""
    feats: list[mx.array] = []
    offset = 0
    for i, (t, h, w) in enumerate(grid.tolist()):
        n = t * h * w
        key = hashes[i]
        f = cache.get(key)
        if f is None:
            f, *_ = model.vision_tower(pixels[offset:offset + n], grid[i:i + 1])
            mx.eval(f)
            cache.put(key, f)
        feats.append(f)
        offset += n
    return mx.concatenate(feats, axis=0)


def vision_prompt_kwargs(model: Any, prompt_tokens: list[int], vision: VisionInputs, cache: FeatureCache
                         ) -> dict[str, Any]:
    """`prompt_kwargs` for BatchGenerator.insert: inputs_embeds with the vision features merged in,
    plus M-RoPE position_ids / rope_deltas."""
    ids = mx.array([prompt_tokens])
    images = vision.pixel_values is not None and vision.image_grid_thw is not None
    videos = vision.pixel_values_videos is not None and vision.video_grid_thw is not None
    if images and videos:
        raise ValueError("images and videos in one request are not supported yet")
    if images:
        assert vision.pixel_values is not None and vision.image_grid_thw is not None
        pixels, grid = to_mx(vision.pixel_values), to_mx(vision.image_grid_thw)
        grid_kw = {"image_grid_thw": grid}
    elif videos:
        assert vision.pixel_values_videos is not None and vision.video_grid_thw is not None
        pixels, grid = to_mx(vision.pixel_values_videos), to_mx(vision.video_grid_thw)
        grid_kw = {"video_grid_thw": grid}
    else:
        raise ValueError("a vision request without pixels")
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    pixels = pixels.astype(dtype)
    features = _encode(model, pixels, grid, vision.content_hashes, cache)
    emb = model.get_input_embeddings(ids, pixels, cached_image_features=features, **grid_kw)
    return {k: v for k, v in emb.to_dict().items() if v is not None}

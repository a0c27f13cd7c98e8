"""A vision request's prompt embeddings, and the encoded image features held on the GPU thread by
content hash (GPU thread only).

How pixels become prompt embeddings depends on their layout (`VisionInputs.layout`, the front
end's processor's choice), one method each (`_LAYOUTS`):
- "patches" (Qwen-VL): the VisionExecutor actor owns the policy (which features are kept, the
  byte budget, eviction, hit and miss counts); this store only executes: it hands out the
  features a request reuses, encodes the others with the vision tower one item at a time (so a
  repeated screenshot next to new images is never re-encoded), keeps what it encoded until told
  to free it, and says what it encoded so the actor can account for it;
- "images" (Gemma 3: whole images of one size): the model's own embedding path,
  `get_input_embeddings(ids, pixel_values, mask)` as mlx-vlm's generate calls it, encodes the
  request's images every time (mlx-vlm offers no public per-image encoder for it, so nothing is
  kept; a prefix-cache hit still skips the prefill of everything up to the snapshot).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

import mlx.core as mx
import numpy as np

from mlx_relay.media.tensors import MediaTensor, VisionInputs


def to_mx(t: MediaTensor) -> mx.array:
    return mx.array(np.frombuffer(t.data, dtype=np.dtype(t.dtype)).reshape(t.shape))


class FeatureStore:
    def __init__(self) -> None:
        self._items: dict[str, mx.array] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            old = self._items.pop(h, None)
            if old is not None:
                self.bytes -= old.nbytes

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def _encode(self, model: Any, pixels: mx.array, grid: mx.array, hashes: tuple[str, ...],
                encoded: list[tuple[str, int]]) -> mx.array:
        """Features of every item, in order: held ones reused, the others encoded one by one."""
        feats: list[mx.array] = []
        offset = 0
        for i, (t, h, w) in enumerate(grid.tolist()):
            n = t * h * w
            key = hashes[i]
            f = self._items.get(key)
            if f is None:
                f, *_ = model.vision_tower(pixels[offset:offset + n], grid[i:i + 1])
                mx.eval(f)
                self._items[key] = f
                self.bytes += f.nbytes
                encoded.append((key, f.nbytes))
            feats.append(f)
            offset += n
        return mx.concatenate(feats, axis=0)

    def prompt_kwargs(self, model: Any, prompt_tokens: list[int], vision: VisionInputs
                      ) -> tuple[dict[str, Any], list[tuple[str, int]]]:
        """The model's prompt inputs for a vision request (inputs_embeds with the features merged
        in; M-RoPE position_ids / rope_deltas where the model has them) and the features encoded
        and kept for it (hash, bytes)."""
        return _LAYOUTS[vision.layout](self, model, prompt_tokens, vision)

    def _whole_images(self, model: Any, prompt_tokens: list[int], vision: VisionInputs
                      ) -> tuple[dict[str, Any], list[tuple[str, int]]]:
        if vision.pixel_values is None:
            raise ValueError("a vision request without pixels")
        ids = mx.array([prompt_tokens])
        emb = model.get_input_embeddings(ids, to_mx(vision.pixel_values), mask=mx.ones_like(ids))
        return {"inputs_embeds": emb.inputs_embeds}, []

    def _patches(self, model: Any, prompt_tokens: list[int], vision: VisionInputs
                 ) -> tuple[dict[str, Any], list[tuple[str, int]]]:
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
        pixels = pixels.astype(model.vision_tower.patch_embed.proj.weight.dtype)
        encoded: list[tuple[str, int]] = []
        features = self._encode(model, pixels, grid, vision.content_hashes, encoded)
        emb = model.get_input_embeddings(ids, pixels, cached_image_features=features, **grid_kw)
        return {k: v for k, v in emb.to_dict().items() if v is not None}, encoded


_Embed = Callable[[FeatureStore, Any, list[int], VisionInputs], tuple[dict[str, Any], list[tuple[str, int]]]]

#: `VisionInputs.layout` -> how the store turns those pixels into prompt inputs.
_LAYOUTS: Final[Mapping[str, _Embed]] = MappingProxyType({"patches": FeatureStore._patches,
                                                          "images": FeatureStore._whole_images})

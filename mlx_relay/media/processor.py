"""What the MediaRouter asks of a model family's media processor (no MLX).

Each VLM family brings one (`served.MEDIA_PROCESSORS` says whose model type loads which): Qwen-VL's
(`preprocess.VisionProcessor` over `qwen_vl.py`: patches and grids, images and video) and Gemma 3's
(`gemma3.Gemma3Processor`: whole images of one size). The router checks the prompt's placeholders
before it downloads anything, decodes the media under the size limits (`pipeline.prepare_vision`,
the same for every family), then hands the decoded items to the processor, which preprocesses them
and expands the prompt's placeholders as the checkpoint's own processor would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from mlx_relay.media.items import DecodedMedia, MediaKind
from mlx_relay.media.tensors import VisionInputs

__all__ = ["MediaProcessor"]


class MediaProcessor(Protocol):
    @property
    def video_frame_bounds(self) -> tuple[int, int | None]:
        """The (min_frames, max_frames) a video is sampled to (images-only processors: (1, None))."""
        ...

    def check_placeholders(self, tokens: Sequence[int], kinds: Sequence[MediaKind]) -> None:
        """Raise a `MediaError` (a 400) unless the rendered prompt holds one placeholder per media item,
        of the kinds and order given, and the processor serves every kind."""
        ...

    def process(self, decoded: Sequence[DecodedMedia], labels: Sequence[str], prompt_tokens: Sequence[int]
                ) -> tuple[list[int], VisionInputs]:
        """The prompt with every placeholder expanded, and the pixels, content hashes and each item's
        span in it. Runs in a worker thread."""
        ...

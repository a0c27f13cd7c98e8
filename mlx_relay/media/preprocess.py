"""The Qwen-VL family's media processor (`VisionProcessor`, a `processor.MediaProcessor`), run off the
GPU thread (MediaRouter, worker thread; no MLX).

The tokenizer is transformers' own (`AutoTokenizer`, as the Normalizer's); the image and video
processors are Qwen-VL's in numpy and PIL (`qwen_vl.py`): transformers' need torch, and mlx-vlm's
torch-free ones cannot be imported without loading MLX, which the server's process never does
when its engine runs in a process of its own (tests/test_layering.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlx_relay.media.errors import MediaDecodeError
from mlx_relay.media.expand import MediaSlot, PromptVocab, check_placeholders, expand_prompt, video_group_timestamps
from mlx_relay.media.items import DecodedImage, DecodedMedia, DecodedVideo, MediaKind
from mlx_relay.media.qwen_vl import ImageProcessor, VideoProcessor, load_processors
from mlx_relay.media.tensors import MediaTensor, VisionInputs

__all__ = ["VisionProcessor", "load_vision_processor"]


@dataclass(frozen=True)
class VisionProcessor:
    """The Qwen-VL family's media processor (a `processor.MediaProcessor`): the parts of a
    checkpoint's processor the MediaRouter uses."""

    image_processor: ImageProcessor
    video_processor: VideoProcessor
    tokenizer: Any
    vocab: PromptVocab

    @property
    def video_frame_bounds(self) -> tuple[int, int | None]:
        """The checkpoint's (min_frames, max_frames) for a video."""
        vp = self.video_processor
        return int(vp.min_frames or 1), vp.max_frames

    def check_placeholders(self, tokens: Sequence[int], kinds: Sequence[MediaKind]) -> None:
        check_placeholders(tokens, kinds, self.vocab)

    def process(self, decoded: Sequence[DecodedMedia], labels: Sequence[str], prompt_tokens: Sequence[int]
                ) -> tuple[list[int], VisionInputs]:
        """Run the checkpoint's processors and expand `prompt_tokens` (worker thread)."""
        images = [(d, label) for d, label in zip(decoded, labels, strict=True) if isinstance(d, DecodedImage)]
        videos = [(d, label) for d, label in zip(decoded, labels, strict=True) if isinstance(d, DecodedVideo)]
        pixel_values = image_grid = video_values = video_grid = None
        image_slots: list[MediaSlot] = []
        video_slots: list[MediaSlot] = []
        if images:
            pixel_values, image_grid, image_slots = self.preprocess_images(
                [d for d, _ in images], [label for _, label in images])
        if videos:
            video_values, video_grid, video_slots = self.preprocess_videos(
                [d for d, _ in videos], [label for _, label in videos])
        image_iter, video_iter = iter(image_slots), iter(video_slots)
        slots = [next(image_iter) if isinstance(d, DecodedImage) else next(video_iter) for d in decoded]
        spans: list[tuple[int, int]] = []
        tokens = expand_prompt(prompt_tokens, slots, self.vocab, spans)
        vision = VisionInputs(
            pixel_values=_tensor(pixel_values),
            image_grid_thw=_tensor(image_grid),
            pixel_values_videos=_tensor(video_values),
            video_grid_thw=_tensor(video_grid),
            content_hashes=tuple(d.content_hash for d in decoded),
            spans=tuple(spans),
        )
        return tokens, vision

    def preprocess_images(self, images: Sequence[DecodedImage], labels: Sequence[str]
                          ) -> tuple[np.ndarray, np.ndarray, list[MediaSlot]]:
        """`pixel_values` (patches, C*T*P*P), `image_grid_thw` (n, 3) and each image's slot."""
        pixels: list[np.ndarray] = []
        grids: list[np.ndarray] = []
        merge = int(self.image_processor.merge_size)
        for image, label in zip(images, labels, strict=True):
            chw = np.ascontiguousarray(image.pixels.transpose(2, 0, 1))
            try:
                out = self.image_processor([chw])
            except ValueError as exc:  # e.g. an aspect ratio past 200:1
                raise MediaDecodeError(f"{label}: cannot be preprocessed: {exc}") from None
            pixels.append(np.asarray(out["pixel_values"]))
            grids.append(np.asarray(out["image_grid_thw"], dtype=np.int64))
        grid = np.concatenate(grids, axis=0)
        slots = [MediaSlot("image", int(np.prod(row)) // merge**2) for row in grid]
        return np.concatenate(pixels, axis=0), grid, slots

    def preprocess_videos(self, videos: Sequence[DecodedVideo], labels: Sequence[str]
                          ) -> tuple[np.ndarray, np.ndarray, list[MediaSlot]]:
        """`pixel_values_videos`, `video_grid_thw` (n, 3) and each video's slot (with timestamps)."""
        vp = self.video_processor
        merge = int(vp.merge_size)
        tps = vp.temporal_patch_size
        pixels: list[np.ndarray] = []
        grids: list[np.ndarray] = []
        slots: list[MediaSlot] = []
        for video, label in zip(videos, labels, strict=True):
            try:
                out = vp([video.frames])
            except ValueError as exc:  # e.g. frames smaller than one merged patch
                raise MediaDecodeError(f"{label}: cannot be preprocessed: {exc}") from None
            grid = np.asarray(out["video_grid_thw"], dtype=np.int64)
            pixels.append(np.asarray(out["pixel_values_videos"]))
            grids.append(grid)
            t, h, w = (int(x) for x in grid[0])
            stamps = video_group_timestamps(video.frame_indices, video.source_fps, tps)
            if len(stamps) != t:  # the processor pads frames to whole groups exactly as we assume
                raise RuntimeError(f"video grid has {t} temporal groups, expected {len(stamps)}")
            slots.append(MediaSlot("video", h * w // merge**2, tuple(stamps)))
        return np.concatenate(pixels, axis=0), np.concatenate(grids, axis=0), slots


def _tensor(array: np.ndarray | None) -> MediaTensor | None:
    return None if array is None else MediaTensor.from_numpy(array)


def load_vision_processor(model_path: Path) -> VisionProcessor:
    """Load the checkpoint's processor (local files only when HF_HUB_OFFLINE=1). Worker thread."""
    from transformers import AutoTokenizer  # (as the Normalizer's: transformers loads when the model does)

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    image_processor, video_processor = load_processors(model_path)

    def token(name: str) -> int:
        value = tokenizer.convert_tokens_to_ids(name)
        if value is None or value == getattr(tokenizer, "unk_token_id", -1):
            raise ValueError(f"{model_path}: the tokenizer has no {name} token")
        return int(value)

    def retokenize(run: Sequence[int], text: str) -> list[int]:
        prefix = ""
        if run:
            prefix = tokenizer.decode(list(run), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return list(tokenizer.encode(prefix + text, add_special_tokens=False))

    vocab = PromptVocab(
        image_pad=token("<|image_pad|>"),
        video_pad=token("<|video_pad|>"),
        vision_start=token("<|vision_start|>"),
        vision_end=token("<|vision_end|>"),
        boundaries=frozenset(int(i) for i in tokenizer.added_tokens_decoder),
        retokenize=retokenize,
    )
    return VisionProcessor(image_processor=image_processor, video_processor=video_processor,
                           tokenizer=tokenizer, vocab=vocab)

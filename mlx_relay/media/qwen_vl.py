"""Qwen-VL image and video preprocessing in numpy and PIL (the MediaRouter's worker thread; no MLX).

A Qwen-VL checkpoint's processor (`preprocessor_config.json`, `video_preprocessor_config.json`)
resizes each image, or each video's frames, to whole merged patches within its pixel budget
(`smart_resize`), rescales and normalizes them, pairs frames along time (an image is repeated to
fill its pair) and cuts them into flattened patches in the vision tower's order. transformers'
processors for it need torch and torchvision, and mlx-vlm's torch-free ones live in a package
whose import loads MLX, which the server's process never does when the engine runs in a process
of its own. This is the same computation as mlx-vlm's (`mlx_vlm.models.qwen3_vl.processing_qwen3_vl`,
itself a port of transformers'), with the same configuration: tests/test_media_processor.py pins
that every output equals mlx-vlm's, bit for bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


@dataclass(frozen=True)
class PatchConfig:
    """One processor's settings, as the checkpoint gives them."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280
    do_rescale: bool = True
    rescale_factor: float = 1 / 255.0
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    @classmethod
    def read(cls, raw: dict[str, Any], **defaults: Any) -> PatchConfig:
        fields = dict(defaults)
        for key in ("patch_size", "temporal_patch_size", "merge_size", "do_rescale", "rescale_factor",
                    "do_normalize", "fps", "min_frames", "max_frames"):
            if key in raw:
                fields[key] = raw[key]
        for key in ("image_mean", "image_std"):
            if raw.get(key):
                fields[key] = tuple(raw[key])
        size = raw.get("size") or {}
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if size.get(edge) is not None:
                fields[key] = size[edge]
            if raw.get(key) is not None:
                fields[key] = raw[key]
        return cls(**fields)


def smart_resize(height: int, width: int, cfg: PatchConfig, frames: int | None = None) -> tuple[int, int]:
    """The (height, width) to resize to: multiples of the merged patch, within the pixel budget
    (of all the frames of a video when `frames` is given)."""
    factor = cfg.patch_size * cfg.merge_size
    if frames is not None and (height < factor or width < factor):
        raise ValueError(f"height:{height} or width:{width} must be larger than factor:{factor}")
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    n = 1 if frames is None else frames
    t_bar = 1 if frames is None else math.ceil(frames / cfg.temporal_patch_size) * cfg.temporal_patch_size
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if t_bar * h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt((n * height * width) / cfg.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (n * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bicubic resize of each (C, H, W) uint8 frame of (T, C, H, W)."""
    t, c, h, w = frames.shape
    if (h, w) == (height, width):
        return frames
    out = np.empty((t, c, height, width), dtype=frames.dtype)
    for i, frame in enumerate(frames):
        pil = Image.fromarray(np.transpose(frame, (1, 2, 0)))
        out[i] = np.transpose(np.array(pil.resize((width, height), resample=Image.BICUBIC)), (2, 0, 1))
    return out


def _patches(frames: np.ndarray, cfg: PatchConfig, height: int, width: int) -> tuple[np.ndarray, list[int]]:
    """(T, C, H, W) uint8 frames resized, normalized, the last repeated to whole temporal patches,
    and cut into the vision tower's flattened patches; and the grid (t, h, w)."""
    resized = _resize(frames, height, width)
    pixels = resized.astype(np.float32)
    if cfg.do_rescale and resized.dtype == np.uint8:
        pixels = pixels * cfg.rescale_factor
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)[None, :, None, None]
        std = np.array(cfg.image_std, dtype=np.float32)[None, :, None, None]
        pixels = (pixels - mean) / std
    pad = (-pixels.shape[0]) % cfg.temporal_patch_size
    if pad:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)], axis=0)
    ps, tps, ms, c = cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size, pixels.shape[1]
    grid = [pixels.shape[0] // tps, height // ps, width // ps]
    t, h, w = grid
    cut = pixels.reshape(t, tps, c, h // ms, ms, ps, w // ms, ms, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return cut.reshape(t * h * w, c * tps * ps * ps), grid


@dataclass(frozen=True)
class ImageProcessor:
    cfg: PatchConfig

    @property
    def merge_size(self) -> int:
        return self.cfg.merge_size

    def __call__(self, images: list[np.ndarray]) -> dict[str, np.ndarray]:
        """(C, H, W) uint8 images -> `pixel_values`, `image_grid_thw`."""
        out = []
        for image in images:
            height, width = smart_resize(image.shape[1], image.shape[2], self.cfg)
            out.append(_patches(image[None], self.cfg, height, width))  # one frame, repeated to a pair
        return {"pixel_values": np.concatenate([p for p, _ in out], axis=0),
                "image_grid_thw": np.array([g for _, g in out], dtype=np.int64)}


@dataclass(frozen=True)
class VideoProcessor:
    cfg: PatchConfig

    @property
    def merge_size(self) -> int:
        return self.cfg.merge_size

    @property
    def temporal_patch_size(self) -> int:
        return self.cfg.temporal_patch_size

    @property
    def min_frames(self) -> int:
        return self.cfg.min_frames

    @property
    def max_frames(self) -> int:
        return self.cfg.max_frames

    def __call__(self, videos: list[np.ndarray]) -> dict[str, np.ndarray]:
        """(T, H, W, C) uint8 videos -> `pixel_values_videos`, `video_grid_thw`."""
        out = []
        for video in videos:
            frames = np.asarray(video)
            if frames.shape[-1] == 4:
                frames = frames[..., :3]
            frames = frames.transpose(0, 3, 1, 2)
            if frames.shape[1] == 1:
                frames = np.repeat(frames, 3, axis=1)
            height, width = smart_resize(frames.shape[2], frames.shape[3], self.cfg, frames=frames.shape[0])
            out.append(_patches(frames, self.cfg, height, width))
        return {"pixel_values_videos": np.concatenate([p for p, _ in out], axis=0),
                "video_grid_thw": np.array([g for _, g in out], dtype=np.int64)}


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load_processors(model_path: Path) -> tuple[ImageProcessor, VideoProcessor]:
    """The checkpoint's image and video processors (video settings from
    `video_preprocessor_config.json`, or beside the image's in older checkpoints)."""
    image_raw = dict(_json(model_path / "preprocessor_config.json") or {})
    image_raw.update((_json(model_path / "processor_config.json") or {}).get("image_processor") or {})
    video_raw = _json(model_path / "video_preprocessor_config.json") or _json(
        model_path / "preprocessor_config.json") or {}
    image = PatchConfig.read(image_raw)
    video = PatchConfig.read(video_raw, min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768)
    return ImageProcessor(image), VideoProcessor(video)

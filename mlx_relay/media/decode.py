"""Decoding fetched bytes into RGB pixels for the MediaRouter, with the size limits applied first.

Images: PIL, restricted to PNG, JPEG, WebP and GIF (first frame), opened lazily so the header's
size is checked against `max_image_pixels` before any pixel is decoded (PIL's own
DecompressionBombError is a 400 too). Videos: MP4 only, decoded by OpenCV (FFmpeg) from a
temporary file; the frame size is checked from the container header, then frames are sampled at
`video_fps`, at most `max_video_frames` (and the checkpoint's own frame bounds). Runs in worker
threads; returns numpy.
"""

from __future__ import annotations

import io
import math
import tempfile

import cv2
import numpy as np
from PIL import Image, UnidentifiedImageError

from mlx_relay.config import MediaConfig
from mlx_relay.media.errors import MediaDecodeError, MediaTooLarge
from mlx_relay.media.hashing import pixels_hash
from mlx_relay.media.items import DecodedImage, DecodedVideo, FetchedMedia
from mlx_relay.media.limits import check_pixels

__all__ = ["IMAGE_FORMATS", "decode_image", "decode_video", "sample_frame_indices"]

#: PIL decoders an image may use; nothing else is tried.
IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF")


def decode_image(item: FetchedMedia, config: MediaConfig) -> DecodedImage:
    """RGB pixels of a PNG/JPEG/WebP/GIF image, refused before decoding if its header is too large."""
    try:
        with Image.open(io.BytesIO(item.data), formats=IMAGE_FORMATS) as img:
            check_pixels(img.width, img.height, config, item.label)  # header only: nothing decoded yet
            rgb = img.convert("RGB")
    except Image.DecompressionBombError:
        raise MediaTooLarge(f"{item.label}: image is too large to decode (decompression bomb guard)") from None
    except UnidentifiedImageError:
        raise MediaDecodeError(f"{item.label}: not a PNG, JPEG, WebP or GIF image") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError) as exc:
        raise MediaDecodeError(f"{item.label}: corrupt image ({type(exc).__name__})") from None
    pixels = np.asarray(rgb, dtype=np.uint8)
    return DecodedImage(pixels=pixels, content_hash=pixels_hash("image", pixels))


def sample_frame_indices(total_frames: int, source_fps: float, fps: float, max_frames: int,
                         min_frames: int = 1) -> list[int]:
    """Indices of the frames to keep: `fps` frames per second of video, between `min_frames` and
    `max_frames` (never more than the video has), spread evenly from the first to the last frame."""
    if total_frames < 1:
        return []
    wanted = round(total_frames / source_fps * fps) if source_fps > 0 else max_frames
    count = max(1, min(max_frames, total_frames, max(wanted, min_frames)))
    if count == 1:
        return [0]
    indices = np.linspace(0, total_frames - 1, count).round().astype(int)
    return sorted({int(i) for i in indices})


def decode_video(item: FetchedMedia, config: MediaConfig, *, min_frames: int = 1,
                 max_frames: int | None = None) -> DecodedVideo:
    """Sampled RGB frames of an MP4 video. `min_frames`/`max_frames` are the processor's bounds;
    `config.max_video_frames` caps them."""
    label = item.label
    if len(item.data) < 12 or item.data[4:8] != b"ftyp":
        raise MediaDecodeError(f"{label}: not an MP4 video")
    limit = min(config.max_video_frames, max_frames) if max_frames else config.max_video_frames
    with tempfile.NamedTemporaryFile(suffix=".mp4") as tmp:
        tmp.write(item.data)
        tmp.flush()
        capture = cv2.VideoCapture(tmp.name, cv2.CAP_FFMPEG)
        try:
            if not capture.isOpened():
                raise MediaDecodeError(f"{label}: corrupt or unsupported video")
            width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
            height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
            total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
            source_fps = float(capture.get(cv2.CAP_PROP_FPS))
            if width < 1 or height < 1 or total < 1 or not math.isfinite(source_fps) or source_fps <= 0:
                raise MediaDecodeError(f"{label}: corrupt video (no frame size, frame count or frame rate)")
            check_pixels(width, height, config, label)  # from the container header, before decoding
            wanted = sample_frame_indices(total, source_fps, config.video_fps, limit, min(min_frames, limit))
            frames, kept = _read_frames(capture, wanted, config, label)
        finally:
            capture.release()
    if not frames:
        raise MediaDecodeError(f"{label}: corrupt video (no frame could be decoded)")
    stacked = np.stack(frames)
    return DecodedVideo(frames=stacked, frame_indices=tuple(kept), source_fps=source_fps,
                        content_hash=pixels_hash("video", stacked))


def _read_frames(capture: cv2.VideoCapture, wanted: list[int], config: MediaConfig, label: str
                 ) -> tuple[list[np.ndarray], list[int]]:
    """Decode frames in order up to the last wanted one (grab skips, retrieve keeps)."""
    keep = set(wanted)
    frames: list[np.ndarray] = []
    kept: list[int] = []
    for index in range(wanted[-1] + 1 if wanted else 0):
        if not capture.grab():
            break  # fewer frames than the header claims: keep what there is
        if index not in keep:
            continue
        ok, frame = capture.retrieve()
        if not ok or frame is None or frame.ndim != 3 or frame.shape[2] != 3:
            raise MediaDecodeError(f"{label}: corrupt video frame {index}")
        check_pixels(frame.shape[1], frame.shape[0], config, label)
        if frames and frame.shape != frames[0].shape:
            raise MediaDecodeError(f"{label}: video frames change size")
        frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        kept.append(index)
    return frames, kept

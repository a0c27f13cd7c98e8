"""MediaRouter decoding: images and videos under the size limits, content hashes, tensors, counts."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from mlx_relay.bench.images import image_pixels, png_bytes
from mlx_relay.config import MediaConfig
from mlx_relay.media.decode import decode_image, decode_video, sample_frame_indices
from mlx_relay.media.errors import MediaDecodeError, MediaTooLarge, TooManyMedia
from mlx_relay.media.items import FetchedMedia, MediaKind
from mlx_relay.media.limits import check_media_counts
from mlx_relay.media.tensors import MediaTensor


def item(data: bytes, kind: MediaKind = "image") -> FetchedMedia:
    return FetchedMedia(kind=kind, data=data, source="data", label=f"media item 1 ({kind})")


def encode(pixels: np.ndarray, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **kw)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A valid 1-bit greyscale PNG of any size, a few KB: its rows are zeros, compressed row by row."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\0" * (1 + (width + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def mp4_bytes(tmp_path: Path, frames: int, fps: float = 4.0, size: tuple[int, int] = (64, 48)) -> bytes:
    path = tmp_path / f"v{frames}-{fps}.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, size)
    assert writer.isOpened()
    for i in range(frames):
        writer.write(np.full((size[1], size[0], 3), (i * 7) % 256, np.uint8))
    writer.release()
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decode_formats_to_rgb(fmt: str) -> None:
    decoded = decode_image(item(encode(image_pixels([2], 50, 20), fmt)), MediaConfig())
    assert decoded.pixels.shape == (20, 50, 3) and decoded.pixels.dtype == np.uint8
    assert len(decoded.content_hash) == 64


def test_decode_converts_modes_to_rgb() -> None:
    rgba = np.dstack([image_pixels([3], 8, 8), np.full((8, 8), 128, np.uint8)])
    for pixels in (rgba, image_pixels([3], 8, 8)[..., 0]):
        assert decode_image(item(encode(pixels, "PNG")), MediaConfig()).pixels.shape == (8, 8, 3)


def test_pixel_limit_checked_from_header() -> None:
    bomb = png_header_only(5000, 5000)  # 25 Mpx claimed, about 4 KB sent
    assert len(bomb) < 20_000
    with pytest.raises(MediaTooLarge, match=r"5000x5000 pixels.*max_image_pixels") as info:
        decode_image(item(bomb), MediaConfig())
    assert info.value.status == 400
    with pytest.raises(MediaTooLarge, match="max_image_pixels"):
        decode_image(item(png_bytes([1], 20, 10)), MediaConfig(max_image_pixels=199))
    assert decode_image(item(png_bytes([1], 20, 10)), MediaConfig(max_image_pixels=200)).pixels.shape == (10, 20, 3)


def test_pil_decompression_bomb_is_400() -> None:
    bomb = png_header_only(20000, 20000)  # 400 Mpx: PIL refuses it itself, at open
    assert len(bomb) < 200_000
    with pytest.raises(MediaTooLarge):
        decode_image(item(bomb), MediaConfig(max_image_pixels=10**9))
    with pytest.raises(MediaTooLarge):
        decode_image(item(bomb), MediaConfig())


@pytest.mark.parametrize("data", [
    b"definitely not an image",
    png_bytes([1], 64, 64)[:200],  # truncated
    png_bytes([1], 64, 64)[:60] + b"\xff" * 500,  # garbage after the header
    b"<svg xmlns='http://www.w3.org/2000/svg'/>",
    b"BM" + b"\0" * 100,  # BMP header: not an accepted format
])
def test_corrupt_or_unaccepted_images_are_400(data: bytes) -> None:
    with pytest.raises(MediaDecodeError) as info:
        decode_image(item(data), MediaConfig())
    assert info.value.status == 400


# ---------------------------------------------------------------------------------------------------------
# Hashes and tensors
# ---------------------------------------------------------------------------------------------------------


def test_identical_pictures_hash_equal_and_different_ones_differ() -> None:
    pixels = image_pixels([4], 33, 17)
    a = decode_image(item(encode(pixels, "PNG", compress_level=1)), MediaConfig())
    b = decode_image(item(encode(pixels, "PNG", compress_level=9)), MediaConfig())
    c = decode_image(item(encode(pixels, "WEBP", lossless=True)), MediaConfig())
    assert a.content_hash == b.content_hash == c.content_hash  # same pixels, other bytes
    assert decode_image(item(encode(pixels, "PNG")), MediaConfig()).content_hash == a.content_hash
    other = pixels.copy()
    other[0, 0, 0] ^= 1
    assert decode_image(item(encode(other, "PNG")), MediaConfig()).content_hash != a.content_hash
    reshaped = decode_image(item(encode(pixels.reshape(33, 17, 3), "PNG")), MediaConfig())
    assert reshaped.content_hash != a.content_hash  # the same bytes in another shape


def test_media_tensor_round_trip() -> None:
    for array in (np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.array([[1, 4, 6]], dtype=np.int64),
                  np.asfortranarray(np.ones((3, 5), np.float32))):
        tensor = MediaTensor.from_numpy(array)
        assert isinstance(tensor.data, bytes) and tensor.shape == array.shape
        np.testing.assert_array_equal(tensor.to_numpy(), array)
        assert tensor.to_numpy().dtype == array.dtype


def test_media_counts() -> None:
    check_media_counts(["image"] * 16 + ["video"] * 2, MediaConfig())
    with pytest.raises(TooManyMedia, match=r"17 images.*max_images_per_request"):
        check_media_counts(["image"] * 17, MediaConfig())
    with pytest.raises(TooManyMedia, match="max_videos_per_request"):
        check_media_counts(["video"] * 2, MediaConfig(max_videos_per_request=1))


# ---------------------------------------------------------------------------------------------------------
# Video
# ---------------------------------------------------------------------------------------------------------


def test_sample_frame_indices() -> None:
    assert sample_frame_indices(12, 4.0, 2.0, 32) == [0, 2, 4, 7, 9, 11]  # 3 s at 2 fps
    assert sample_frame_indices(1000, 10.0, 2.0, 32) == sorted(set(np.linspace(0, 999, 32).round().astype(int)))
    assert sample_frame_indices(3, 30.0, 2.0, 32, min_frames=2) == [0, 2]
    assert sample_frame_indices(1, 30.0, 2.0, 32, min_frames=4) == [0]
    assert sample_frame_indices(0, 30.0, 2.0, 32) == []


def test_decode_mp4(tmp_path: Path) -> None:
    video = decode_video(item(mp4_bytes(tmp_path, 12), "video"), MediaConfig())
    assert video.frames.shape == (6, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.frame_indices == (0, 2, 4, 7, 9, 11) and video.source_fps == pytest.approx(4.0)
    assert abs(int(video.frames[1].mean()) - 14) <= 3  # frame 2 was painted 2*7
    again = decode_video(item(mp4_bytes(tmp_path / "..", 12), "video"), MediaConfig())
    assert again.content_hash == video.content_hash


def test_video_frame_limit(tmp_path: Path) -> None:
    data = mp4_bytes(tmp_path, 40, fps=10.0)  # 4 s: 8 frames at 2 fps
    assert len(decode_video(item(data, "video"), MediaConfig()).frame_indices) == 8
    capped = decode_video(item(data, "video"), MediaConfig(max_video_frames=3))
    assert capped.frame_indices == (0, 20, 39) and capped.frames.shape[0] == 3
    assert len(decode_video(item(data, "video"), MediaConfig(), max_frames=5).frame_indices) == 5
    dense = decode_video(item(data, "video"), MediaConfig(video_fps=100.0))
    assert len(dense.frame_indices) == 32  # every frame wanted, capped at max_video_frames


def test_video_limits_and_corruption(tmp_path: Path) -> None:
    data = mp4_bytes(tmp_path, 4)
    with pytest.raises(MediaTooLarge, match="max_image_pixels"):
        decode_video(item(data, "video"), MediaConfig(max_image_pixels=64 * 48 - 1))
    with pytest.raises(MediaDecodeError, match="not an MP4"):
        decode_video(item(png_bytes([1], 8, 8), "video"), MediaConfig())
    for bad in (data[:40], data[:8] + b"\0" * 2000, data[:400] + bytes(reversed(data[400:]))):
        with pytest.raises(MediaDecodeError):
            decode_video(item(bad, "video"), MediaConfig())

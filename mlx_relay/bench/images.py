"""Deterministic PNG images as `data:` URLs, for the image scenarios.

An image is a function of its key (a few integers): a smooth two-colour gradient with a few solid
rectangles and a little noise (so it compresses like a picture, not like noise or a flat fill),
drawn with numpy from a generator seeded by the key and encoded by PIL with fixed settings.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np
from PIL import Image


def image_pixels(key: Sequence[int], width: int, height: int) -> np.ndarray:
    """An (height, width, 3) uint8 picture that depends only on `key` and the size."""
    rng = np.random.default_rng([0x1A6E, *key])
    c0, c1 = rng.integers(0, 256, size=(2, 3)).astype(np.float32)
    angle = rng.uniform(0, np.pi)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    t = (np.cos(angle) * xx / max(width, 1) + np.sin(angle) * yy / max(height, 1)) / 2 + 0.25
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    for _ in range(int(rng.integers(2, 7))):
        x0, x1 = sorted(rng.integers(0, width, size=2))
        y0, y1 = sorted(rng.integers(0, height, size=2))
        img[y0:y1 + 1, x0:x1 + 1] = rng.integers(0, 256, size=3)
    img += rng.normal(0, 4, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def png_bytes(key: Sequence[int], width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image_pixels(key, width, height)).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def png_data_url(key: Sequence[int], width: int, height: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(key, width, height)).decode("ascii")

"""Content hashes of decoded media: the keys the vision executor caches encoded features under.

A hash covers the decoded pixels (RGB, uint8) with their kind and shape, not the encoded bytes:
the same picture sent as another data URL or another lossless encoding hashes the same, and two
different pictures never share a hash (short of a SHA-256 collision).
"""

from __future__ import annotations

import hashlib

import numpy as np

from mlx_relay.media.items import MediaKind


def pixels_hash(kind: MediaKind, pixels: np.ndarray) -> str:
    """Hex SHA-256 of `kind`, the array's shape and dtype, and its bytes in C order."""
    contiguous = np.ascontiguousarray(pixels)
    digest = hashlib.sha256(f"{kind}:RGB:{contiguous.dtype.name}:{contiguous.shape}\0".encode())
    digest.update(memoryview(contiguous.reshape(-1)))
    return digest.hexdigest()

"""Where our kernels run (GPU thread only): asked by each kernel's dispatch in `kernels/` when a
step is traced."""

from __future__ import annotations

import mlx.core as mx


def cuda_kernels_available() -> bool:
    """True where a step traced now runs on a CUDA GPU (the kernels' backend)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()

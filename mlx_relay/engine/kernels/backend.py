"""Where our kernels run (GPU thread only): asked by each kernel's dispatch in `kernels/` when a
step is traced; and what MLX's CUDA backend cannot run, which the engine keeps its work within
(`engine/lane_set.py`)."""

from __future__ import annotations

import mlx.core as mx


def cuda_kernels_available() -> bool:
    """True where a step traced now runs on a CUDA GPU (the kernels' backend)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


#: MLX 0.32's CUDA backend puts a batch's rows on a kernel grid's y or z axis, at most 65,535 of
#: them: a forward whose mixture of experts routes more (token, expert) rows than that fails at
#: launch (`cuGraphAddKernelNode ... invalid argument`; 8,192 tokens x 8 experts, the library's
#: forward as ours: benchmarks/results/prefill-h100-2026-11-28/).
CUDA_MAX_GRID_ROWS = 65535


def max_chunk_tokens(routed_per_token: int, backend: str) -> int | None:
    """The most tokens one forward may run on `backend` when each routes to `routed_per_token`
    experts (None: no limit)."""
    if backend != "cuda" or routed_per_token < 1:
        return None
    return CUDA_MAX_GRID_ROWS // routed_per_token

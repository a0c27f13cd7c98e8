"""Chunk selection for SpecPrefill (run by the engine's scoring stage on the scores; pure Python).

The draft model's per-token importance scores cover the prompt's scored region
`[start, start + len(scores))` (the part the prefix cache does not cover). The region is cut into
chunks of `chunk_size` tokens, each chunk scored by the mean of its tokens; the top
`ceil(keep_fraction * chunks)` chunks are kept, the first and the last always (the last holds the
question the reply answers, the first the context's opening). Everything before `start` is kept
too: it is restored from the cache or holds a snapshot point the prefix cache needs exactly.
Ties go to the earlier chunk, so the selection is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mlx_relay.messages.specprefill import SparsePrefill


def select_chunks(scores: Sequence[float], *, start: int, chunk_size: int, keep_fraction: float) -> SparsePrefill:
    """The kept positions of a prompt of `start + len(scores)` tokens, as ascending ranges."""
    if chunk_size < 1 or not 0.0 < keep_fraction <= 1.0:
        raise ValueError("chunk_size must be >= 1 and keep_fraction in (0, 1]")
    n = len(scores)
    total = start + n
    chunks = math.ceil(n / chunk_size)
    if chunks <= 2 or keep_fraction >= 1.0:
        return SparsePrefill([(0, total)] if total else [])
    want = max(2, math.ceil(keep_fraction * chunks))
    means = [math.fsum(scores[i * chunk_size:(i + 1) * chunk_size]) / len(scores[i * chunk_size:(i + 1) * chunk_size])
             for i in range(chunks)]
    middle = sorted(range(1, chunks - 1), key=lambda i: (-means[i], i))
    kept = sorted({0, chunks - 1, *middle[:want - 2]})
    ranges: list[tuple[int, int]] = [(0, start)] if start else []
    for i in kept:
        a, b = start + i * chunk_size, min(total, start + (i + 1) * chunk_size)
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return SparsePrefill(ranges)


def kept_positions(sparse: SparsePrefill) -> list[int]:
    """Every kept prompt position, ascending."""
    return [p for a, b in sparse.ranges for p in range(a, b)]

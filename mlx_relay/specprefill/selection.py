"""Chunk selection for SpecPrefill (run by the engine's scoring stage on the scores; pure Python).

The draft model's per-token importance scores cover the prompt's scored region
`[start, start + len(scores))` (the part the prefix cache does not cover). The region is cut into
chunks of `chunk_size` tokens, each chunk scored by the mean of its tokens; `ceil(keep_fraction *
chunks)` chunks are kept, the first and the last always (the last holds the question the reply
answers, the first the context's opening). Of the rest of that budget, the `anchors` go first
(chunks that share a run of tokens with the query, `specprefill.anchors`), in at most
`anchor_share` of it (the highest-scored ones when there are more), then the best-scoring chunks. Everything before
`start` is kept too: it is restored from the cache or holds a snapshot point the prefix cache
needs exactly. Ties go to the earlier chunk, so the selection is deterministic; without anchors
it is the scores' selection alone.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import msgspec

from mlx_relay.messages.specprefill import SparsePrefill


class ChunkSelection(msgspec.Struct, frozen=True):
    """What `select_chunks` kept, and what the anchors did to it."""

    sparse: SparsePrefill
    anchored: int = 0  # anchor chunks kept (the first and last chunk aside: they are kept anyway)
    rescued: int = 0  # of those, the ones the scores alone would have dropped
    dropped: int = 0  # anchor chunks the budget had no room for


def select_chunks(scores: Sequence[float], *, start: int, chunk_size: int, keep_fraction: float,
                  anchors: Collection[int] = (), anchor_share: float = 1.0) -> ChunkSelection:
    """The kept positions of a prompt of `start + len(scores)` tokens, as ascending ranges;
    `anchors`: chunk indices (0: the chunk at `start`) kept ahead of the scores, in at most
    `anchor_share` of the budget beyond the first and last chunk (rounded up)."""
    if chunk_size < 1 or not 0.0 < keep_fraction <= 1.0 or not 0.0 < anchor_share <= 1.0:
        raise ValueError("chunk_size must be >= 1, keep_fraction and anchor_share in (0, 1]")
    n = len(scores)
    total = start + n
    chunks = math.ceil(n / chunk_size)
    if chunks <= 2 or keep_fraction >= 1.0:
        return ChunkSelection(SparsePrefill([(0, total)] if total else []))
    budget = max(2, math.ceil(keep_fraction * chunks)) - 2  # chunks beyond the first and the last
    means = [math.fsum(scores[i * chunk_size:(i + 1) * chunk_size]) / len(scores[i * chunk_size:(i + 1) * chunk_size])
             for i in range(chunks)]
    middle = sorted(range(1, chunks - 1), key=lambda i: (-means[i], i))
    marked = set(anchors)
    room = math.ceil(anchor_share * budget)
    anchored = [i for i in middle if i in marked][:room]  # the highest-scored anchors first
    taken = set(anchored)
    rest = [i for i in middle if i not in taken][:budget - len(anchored)]
    kept = sorted({0, chunks - 1, *anchored, *rest})
    ranges: list[tuple[int, int]] = [(0, start)] if start else []
    for i in kept:
        a, b = start + i * chunk_size, min(total, start + (i + 1) * chunk_size)
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    candidates = sum(1 for i in marked if 0 < i < chunks - 1)
    rescued = len(taken.difference(middle[:budget]))
    return ChunkSelection(SparsePrefill(ranges), len(anchored), rescued, candidates - len(anchored))


def kept_positions(sparse: SparsePrefill) -> list[int]:
    """Every kept prompt position, ascending."""
    return [p for a, b in sparse.ranges for p in range(a, b)]

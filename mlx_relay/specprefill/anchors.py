"""SpecPrefill's anchors: the chunks of a long prompt that its query names (pure Python and numpy, no MLX).

Run by the engine's scoring stage (`engine/scoring/stage.py`, on the GPU thread between engine steps)
next to `selection.select_chunks`, which keeps these chunks ahead of the draft's scores.

A question about a long context usually repeats what it asks about: "What is the code for ABC-12?"
after "The code for ABC-12 is 123456.", a coding agent's "what does select_chunks return" after
the file that defines it. The draft model's attention may still rate that line low, and a chunk
it rates low is not prefilled: the answer is gone. An *anchor* is an occurrence, before the
query, of a run of `rule.ngram` tokens (an n-gram) that also occurs in the query (the prompt's
last `rule.query_tokens` tokens), together with the `rule.follow` tokens after it (what a name is
followed by: a key's value, a function's body). The chunks of the scored region it covers are
anchor chunks (both, when it straddles a boundary). N-grams found more than
`rule.max_occurrences` times before the query are boilerplate (the chat template's turn markers,
a tool-call wrapper, a license header) and anchor nothing; the query's own chunks are never
anchors (the last one is always kept anyway).

Cost: O(prompt length) in numpy. Every n-gram of the prompt gets a 64-bit polynomial hash
(arithmetic modulo 2^64); the ones before the query are looked up among the query's few hashes
(a table of their low bits, then a `searchsorted` of the few that pass it), and only the hits of
rare enough hashes are checked token by token in Python (at most `max_occurrences` per query
n-gram), so a hash collision never makes an anchor. (Two different n-grams sharing a hash would
be counted together, which can only drop a rare anchor; with 64-bit hashes over a 256K-token
prompt the chance is about 1e-12.) 128K tokens take about 4 ms on one CPU core
(`benchmarks/specprefill_anchors.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlx_relay.config import SpecPrefillConfig
from mlx_relay.messages.specprefill import AnchorRule

#: the hash's multiplier: odd, so that every token id moves all 64 bits (the golden ratio's bits)
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
#: entries of the low-bits prefilter (a power of two; 64 KiB of booleans)
_TABLE = 1 << 16


def anchor_rule(config: SpecPrefillConfig, ngram: int | None = None) -> AnchorRule | None:
    """The rule of a server with `config` for a request asking for `ngram`-token anchors (None:
    the server's length; 0: no anchors). The query holds at least one n-gram, however long."""
    n = config.anchor_ngram if ngram is None else ngram
    if n <= 0:
        return None
    return AnchorRule(n, max(config.anchor_query_tokens, n), config.anchor_max_occurrences, config.anchor_follow,
                      config.anchor_max_share)


def ngram_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """The hash of every run of `n` tokens of `ids` (uint64; entry i: ids[i:i + n])."""
    m = len(ids) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    values = ids.astype(np.uint64, copy=False) + np.uint64(1)  # + 1: a token 0 still moves the hash
    h = values[:m].copy()
    for j in range(1, n):
        h *= _MULTIPLIER
        h += values[j:j + m]
    return h


def anchor_chunks(tokens: Sequence[int], *, start: int, chunk_size: int, rule: AnchorRule) -> frozenset[int]:
    """The anchor chunks of the scored region `[start, len(tokens))` cut into `chunk_size`-token
    chunks, as chunk indices (0: the chunk at `start`)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    n, total = rule.ngram, len(tokens)
    query = max(0, total - rule.query_tokens)  # the query's first position
    before = (query - start) // chunk_size  # chunks before this one hold no query token
    context = query - n + 1  # n-grams starting before this lie wholly before the query
    if before <= 0 or context <= 0 or total - query < n:
        return frozenset()
    h = ngram_hashes(np.fromiter(tokens, dtype=np.uint64, count=total), n)
    wanted = np.unique(h[query:])
    ctx = h[:context]
    # a table of the query hashes' low bits passes about one in a thousand others, and then only
    # those few are looked up (a searchsorted over every position costs ten times as much)
    table = np.zeros(_TABLE, dtype=np.bool_)
    table[wanted & np.uint64(_TABLE - 1)] = True
    hits = np.flatnonzero(table[ctx & np.uint64(_TABLE - 1)])
    slot = np.minimum(np.searchsorted(wanted, ctx[hits]), len(wanted) - 1)
    found = wanted[slot] == ctx[hits]
    hits, slot = hits[found], slot[found]
    if not hits.size:
        return frozenset()
    counts = np.bincount(slot, minlength=len(wanted))  # occurrences before the query, per query hash
    hits = hits[counts[slot] <= rule.max_occurrences]
    grams = {tuple(tokens[i:i + n]) for i in range(query, total - n + 1)}
    chunks: set[int] = set()
    for i in hits.tolist():
        end = min(i + n + rule.follow, total)
        if end <= start or tuple(tokens[i:i + n]) not in grams:
            continue  # in the restored prefix (kept anyway), or a hash collision
        first = (max(i, start) - start) // chunk_size
        last = (end - 1 - start) // chunk_size
        chunks.update(c for c in range(first, last + 1) if c < before)
    return frozenset(chunks)

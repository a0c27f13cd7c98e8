"""Drafts copied from a request's own context (no MLX; used by the MTP lane's rows on the GPU thread).

Coding agents re-emit what is already in their context: a path from a listing, a file with one
line changed, facts from a tool result. `ContextDrafts` keeps an index of every n-gram (n from
`max_ngram` down to 1) of the row's prompt and output to the position that followed its most
recent occurrence; a proposal is what followed the longest n-gram matching the sequence's latest
tokens (prompt lookup decoding; the most recent occurrence, as an agent's latest version of a
file is the one it edits). No model call: a proposal costs a few dict lookups. The index is built
as proposals are asked for, at most `index_per_call` positions each time (a 32K-token prompt
indexed at once held the GPU thread for 130 ms at a row's join, every other row's decode with it);
until it has caught up, proposals come from the part indexed so far.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlx_relay.engine.speculation.earnings import Source


class ContextDrafts:
    source: Source = "context"  # the `proposer.Proposer` protocol's
    costly = False

    def ready(self) -> bool:
        """Always: its index catches up inside `propose`, a bounded piece a call."""
        return True
    def __init__(self, tokens: Iterable[int] = (), *, max_ngram: int = 4, index_per_call: int = 1024) -> None:
        if max_ngram < 1:
            raise ValueError("max_ngram must be at least 1")
        self.max_ngram = max_ngram
        self.index_per_call = index_per_call
        self.tokens: list[int] = [int(t) for t in tokens]
        # n-gram (as a tuple) -> the position after its most recent occurrence, for the n-grams
        # ending before position `_indexed` (each followed by a token)
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def indexed(self) -> int:
        """Positions indexed so far (the n-grams ending before it)."""
        return self._indexed

    def extend(self, tokens: Iterable[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def _index(self) -> None:
        """Index up to `index_per_call` more positions, oldest first (later occurrences overwrite)."""
        toks, nxt = self.tokens, self._next
        stop = min(len(toks), self._indexed + self.index_per_call)
        for end in range(self._indexed, stop):  # the n-grams ending at toks[end - 1], followed by toks[end]
            for n in range(1, min(self.max_ngram, end) + 1):
                nxt[tuple(toks[end - n:end])] = end
        self._indexed = max(self._indexed, stop)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest n-gram equal to the latest tokens (empty:
        none of them occurred before, as far as indexed)."""
        toks = self.tokens
        if k <= 0 or not toks:
            return []
        self._index()
        for n in range(min(self.max_ngram, len(toks)), 0, -1):
            at = self._next.get(tuple(toks[len(toks) - n:]))
            if at is not None:
                return toks[at:at + k]
        return []

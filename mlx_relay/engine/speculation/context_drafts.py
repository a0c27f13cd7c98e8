"""Drafts copied from a request's own context (no MLX; used by the MTP lane's rows on the GPU thread).

Coding agents re-emit what is already in their context: a path from a listing, a file with one
line changed, facts from a tool result. `ContextDrafts` keeps an index of every n-gram (n from
`max_ngram` down to 1) of the row's prompt and output to the position that followed its most
recent occurrence; a proposal is what followed the longest n-gram matching the sequence's latest
tokens (prompt lookup decoding; the most recent occurrence, as an agent's latest version of a
file is the one it edits). No model call: a proposal costs a few dict lookups, and appending a
token indexes `max_ngram` keys.
"""

from __future__ import annotations

from collections.abc import Iterable


class ContextDrafts:
    def __init__(self, tokens: Iterable[int] = (), *, max_ngram: int = 4) -> None:
        if max_ngram < 1:
            raise ValueError("max_ngram must be at least 1")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n-gram (as a tuple) -> the position after its most recent occurrence that is followed
        # by a token (the n-grams ending at the last token are indexed when the next one comes)
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        for t in tokens:
            end = len(toks)  # the n-grams ending at toks[end - 1] are now followed by `t`
            for n in range(1, min(self.max_ngram, end) + 1):
                self._next[tuple(toks[end - n:end])] = end
            toks.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest n-gram equal to the latest tokens (empty:
        no n-gram of them occurred before)."""
        toks = self.tokens
        if k <= 0 or not toks:
            return []
        for n in range(min(self.max_ngram, len(toks)), 0, -1):
            at = self._next.get(tuple(toks[len(toks) - n:]))
            if at is not None:
                return toks[at:at + k]
        return []

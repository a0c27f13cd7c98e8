"""Incremental, UTF-8-safe detokenization and stop-string matching for one sequence.

Built on `tokenizers.decoders.DecodeStream` (Rust), which holds back bytes until they form
whole characters. The stop matcher holds back any tail that could still become a stop string,
so streamed text never shows part of a stop sequence. Pure Python, no MLX.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stream = DecodeStream(skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        if not 0 <= token_id < self._vocab_size:
            # A padded-vocabulary id with no token behind it: it decodes to nothing.
            return ""
        return self._stream.step(self._tokenizer, token_id) or ""


class StopMatcher:
    """Finds the first stop string in streamed text; releases only text that is safe."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None  # the stop string that was hit

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at], True
        keep = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """At the end of generation the held tail is plain text after all."""
        held, self._held = self._held, ""
        return held

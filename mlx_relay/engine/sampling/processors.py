"""Per-row logits processors (GPU thread only): logprobs, penalties, grammars, thinking budgets.

The lanes' decoding (`lanes/decode_batch.py`, `lanes/kv_lane.py`) applies a row's processors to
that row's logits before sampling, calling `process_last_token(last_token, logits)` when a
processor has it; our own prefill calls them the same way for a row's first token. The first
call of a row sees the prompt's last token, every later call the token sampled just before.

A row's chain is built by `step/logits.LogitsChains` in this order: the logprob recorder (it sees
the model's raw distribution), penalties, the thinking budget, the grammar mask (it starts after
the thinking block when the prompt opened one), and last the `RowSampler` when the row samples.
Rows with logprobs, penalties or a thinking budget decode in the plain lane, never in the MTP
lane (whose verification would have to replay them for every drafted position); a row with only a
grammar (and a sampler) may take the MTP lane, which applies the grammar inside its round itself
(`lanes/mtp_grammar.py`).

A processor never raises into the batch (that would fail every row of the step): a grammar
that reaches an error state records it and forces end-of-sequence, and the engine ends that row
with the error.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from mlx_relay.chat.output import TokenLogprob, TopLogprob
from mlx_relay.runtime.supervision import is_failure


class RowProcessor:
    """Base: turns the `(tokens, logits)` call into `process_last_token(last, logits)`."""

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        return self.process_last_token(int(tokens[-1].item()), logits)

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        raise NotImplementedError


class LogprobRecorder(RowProcessor):
    """Records each step's log-probabilities; the engine takes them, oldest first, as the
    row's tokens come out (decode is double-buffered, so a step may be recorded before the
    previous token is read)."""

    def __init__(self, top: int, decode: Any) -> None:
        self.top = top
        self._decode = decode
        self._pending: deque[mx.array] = deque()

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        lp = logits.astype(mx.float32)
        lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
        self._pending.append(lp.reshape(-1))
        return logits

    def take(self, token: int) -> TokenLogprob | None:
        if not self._pending:
            return None
        lp = self._pending.popleft()
        chosen = float(lp[token].item())
        top: list[TopLogprob] = []
        if self.top > 0:
            k = min(self.top, lp.shape[0])
            idx = mx.argpartition(-lp, k - 1)[:k]
            vals = lp[idx]
            order = mx.argsort(-vals)
            for i, v in zip(idx[order].tolist(), vals[order].tolist(), strict=True):
                text = self._decode(i)
                top.append(TopLogprob(text, float(v), list(text.encode())))
        text = self._decode(token)
        return TokenLogprob(text, chosen, list(text.encode()), top)


class Penalties(RowProcessor):
    """OpenAI's presence and frequency penalties and a multiplicative repetition penalty, over
    the tokens this row has generated (not the prompt)."""

    def __init__(self, presence: float, frequency: float, repetition: float | None) -> None:
        self.presence = presence
        self.frequency = frequency
        self.repetition = repetition
        self._counts: dict[int, int] = {}
        self._first = True

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        if self._first:
            self._first = False
        else:
            self._counts[last_token] = self._counts.get(last_token, 0) + 1
        if not self._counts:
            return logits
        ids = mx.array(list(self._counts))
        counts = mx.array(list(self._counts.values()), dtype=mx.float32)
        picked = logits[..., ids]
        if self.repetition is not None and self.repetition != 1.0:
            picked = mx.where(picked > 0, picked / self.repetition, picked * self.repetition)
        picked = picked - (self.presence + self.frequency * counts).astype(logits.dtype)
        logits[..., ids] = picked
        return logits


def _only(token: int, logits: mx.array) -> mx.array:
    vocab = mx.arange(logits.shape[-1])
    return mx.where(vocab == token, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarMark(NamedTuple):
    """A `GrammarMask`'s state to return to (`GrammarMask.mark`, `GrammarMask.restore`)."""

    active: bool
    consumed: int
    error: str | None


class GrammarMask(RowProcessor):
    """llguidance: only tokens the grammar allows next. With `activate_after` (the thinking
    block's end token) the grammar starts after the model closes its thinking.

    As a processor (the plain lanes) each call consumes the token sampled before it and masks
    the next. The MTP lane drives it directly (`mtp_grammar.py`): `feed` an emitted or drafted
    token, `allows` / `masked` / `allowed` for the state after the tokens fed, and `mark` /
    `restore` to roll back the drafts it tried."""

    def __init__(self, matcher: Any, eos: int, n_vocab: int, activate_after: int | None = None) -> None:
        import llguidance.numpy

        self._fill = llguidance.numpy.fill_next_token_bitmask
        self.matcher = matcher
        self.eos = eos
        self.active = activate_after is None
        self.activate_after = activate_after
        self.error: str | None = None
        self._first = True
        self._consumed = 0  # tokens the matcher consumed (what `restore` rolls back)
        self._filled: bool | None = None  # the bitmask holds this state's mask (False: EOS only); None: not yet
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, n_vocab)
        self._mask_bits: np.ndarray | None = None  # the bitmask `_last_mask` was made from
        self._mask_vocab = 0
        self._last_mask: mx.array | None = None

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        first, self._first = self._first, False
        if not first:  # the token sampled before this call (none on a row's first call)
            self.feed(last_token)
        return self.masked(logits)

    def feed(self, token: int) -> None:
        """The row goes on with `token` (the thinking block's end only activates the grammar)."""
        if not self.active:
            if token == self.activate_after:
                self.active, self._filled = True, None  # the block's end is not the grammar's
            return
        self._filled = None
        try:  # llguidance is native code: a panic (a BaseException) is this row's error, not the batch's
            if self.error is None and not self.matcher.is_stopped():
                if self.matcher.consume_token(token):
                    self._consumed += 1
                else:
                    self.error = self.matcher.get_error() or f"token {token} is not allowed by the grammar"
        except BaseException as exc:
            if not is_failure(exc):
                raise
            self.error = f"the grammar engine failed ({type(exc).__name__})"

    def mark(self) -> GrammarMark:
        return GrammarMark(self.active, self._consumed, self.error)

    def restore(self, mark: GrammarMark) -> None:
        """Back to `mark`: the tokens fed since are rolled back (tried drafts)."""
        n = self._consumed - mark.consumed
        self.active, self.error, self._filled = mark.active, mark.error, None
        if n > 0:
            try:
                if not self.matcher.rollback(n):
                    self.error = self.matcher.get_error() or "the grammar could not roll back"
            except BaseException as exc:
                if not is_failure(exc):
                    raise
                self.error = f"the grammar engine failed ({type(exc).__name__})"
        self._consumed = mark.consumed

    def _fill_now(self) -> bool:
        """This state's bitmask, filled once: True when it holds the mask, False when only EOS may follow
        (the grammar is done or failed)."""
        if self._filled is None:
            try:
                if self.error is None and not self.matcher.is_stopped():
                    self._fill(self.matcher, self._bitmask, 0)
                    if self.matcher.is_error():
                        self.error = self.matcher.get_error() or "the grammar failed"
            except BaseException as exc:
                if not is_failure(exc):
                    raise
                self.error = f"the grammar engine failed ({type(exc).__name__})"
            self._filled = self.error is None and not self.matcher.is_stopped()
        return self._filled

    def allows(self, token: int) -> bool:
        """Whether the grammar lets `token` come next (what `masked` keeps)."""
        if not self.active:
            return True
        if not self._fill_now():
            return token == self.eos
        word = token >> 5
        return 0 <= word < self._bitmask.shape[1] and bool((int(self._bitmask[0, word]) >> (token & 31)) & 1)

    def allowed(self, vocab: int) -> mx.array | None:
        """The tokens that may come next as a boolean mask over `vocab`; None: every token."""
        if not self.active:
            return None
        if not self._fill_now():
            return mx.arange(vocab) == self.eos
        return self._mask(vocab)

    def masked(self, logits: mx.array) -> mx.array:
        """`logits` with every token the grammar does not allow next at -inf."""
        allowed = self.allowed(logits.shape[-1])
        if allowed is None:
            return logits
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _mask(self, vocab: int) -> mx.array:
        """The bitmask as an MLX boolean mask over `vocab`; the last one again while the bitmask is
        unchanged (free text under a lazy tool grammar: the same mask for token after token)."""
        if self._mask_bits is not None and self._mask_vocab == vocab and np.array_equal(self._bitmask, self._mask_bits):
            assert self._last_mask is not None
            return self._last_mask
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        if allowed.shape[0] < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=np.uint8)])
        self._last_mask = mx.array(allowed[:vocab].astype(np.bool_))
        self._mask_bits, self._mask_vocab = self._bitmask.copy(), vocab
        return self._last_mask


class ThinkingBudget(RowProcessor):
    """Caps the thinking tokens: once `budget` tokens were generated inside the thinking block,
    the block's end (`close`, e.g. the tokens of "\\n</think>\\n\\n") is forced token by token."""

    def __init__(self, budget: int, close: list[int], end_token: int, start_token: int | None,
                 thinking: bool) -> None:
        self.budget = budget
        self.close = close
        self.end_token = end_token
        self.start_token = start_token
        self.thinking = thinking
        self.used = 0
        self._forcing: list[int] = []
        self._first = True

    def process_last_token(self, last_token: int, logits: mx.array) -> mx.array:
        if self._first:
            self._first = False
        elif self.thinking:
            if last_token == self.end_token:
                self.thinking = False
            else:
                self.used += 1
        elif last_token == self.start_token and self.used == 0:
            self.thinking = True
        if self._forcing:
            return _only(self._forcing.pop(0), logits)
        if self.thinking and self.used >= self.budget:
            self._forcing = list(self.close)
            return _only(self._forcing.pop(0), logits)
        return logits

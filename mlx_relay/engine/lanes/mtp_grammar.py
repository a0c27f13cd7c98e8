"""A row's output grammar inside the MTP round (GPU thread only; used by `mtp_cohort.EagerCohort`,
`mtp_sampling` and `mtp_prefill`).

Between rounds a grammar row's matcher (`step.processors.GrammarMask`) has consumed every token the
row emitted, and nothing else. The head drafts freely (its drafts are never masked: a draft the
grammar forbids is simply rejected). The target's logits at verified position j are masked by
the grammar's state after ``bonus, d_1 .. d_j``, exactly what the plain lane would mask them with
had it emitted those tokens, so:

- greedy (`greedy_walk`): draft d_{j+1} is accepted iff it equals the argmax of the masked logits
  at j; the first position that rejects emits that masked argmax. The unmasked argmax (already
  on the host) is that token whenever the grammar allows it (a mask only removes tokens; ties go
  to the lowest id either way), so the masked logits are read back only where the grammar
  forbids the target's own choice;
- sampling (`draft_masks`): the speculative-sampling walk runs on the masked distributions p'
  (the drafts' q stays the head's): accept d with probability min(1, p'(d)/q(d)), else draw from
  norm(max(p' - q, 0)); a forbidden draft has p'(d) = 0 and is always rejected. That keeps the
  target's masked distribution, the plain lane's.

Both walk the matcher through the drafts and roll it back (`GrammarMask.mark` / `restore`); the
cohort then feeds the round's emitted tokens (`feed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.sampling.processors import GrammarMask


def greedy_walk(grammar: GrammarMask, head: MTPHead, vh: mx.array, drafts: Sequence[int],
                targets: Sequence[int]) -> tuple[int, int]:
    """(drafts accepted, the token emitted after them) of a greedy grammar row. `vh` [1, k, H] are the
    target's hidden states over ``[bonus, d_1 .. d_{k-1}]``, `targets` their unmasked argmaxes."""
    mark = grammar.mark()
    try:
        for j, target in enumerate(targets):
            if not grammar.allows(target):
                target = int(mx.argmax(grammar.masked(head.logits(vh[:, j:j + 1, :])), axis=-1).item())
            if j == len(drafts) or drafts[j] != target:
                return j, target
            grammar.feed(drafts[j])
        raise AssertionError("unreachable: the last position always emits")
    finally:
        grammar.restore(mark)


def draft_masks(grammar: GrammarMask, drafts: Sequence[int], vocab: int) -> mx.array:
    """The grammar's masks [k, vocab] at the k verified positions of a sampling row: position j after
    ``d_1 .. d_j``. Past a draft the grammar forbids every position is left open (the walk stops at
    that draft: its p' is 0)."""
    mark = grammar.mark()
    open_ = mx.ones((vocab,), dtype=mx.bool_)
    masks: list[mx.array] = []
    try:
        for j in range(len(drafts) + 1):
            allowed = grammar.allowed(vocab)
            masks.append(open_ if allowed is None else allowed)
            if j == len(drafts):
                break
            if not grammar.allows(drafts[j]):
                masks += [open_] * (len(drafts) - j)
                break
            grammar.feed(drafts[j])
    finally:
        grammar.restore(mark)
    return mx.stack(masks)


def feed(grammar: GrammarMask | None, tokens: Sequence[int]) -> None:
    """The row emitted `tokens`: its matcher consumes them."""
    if grammar is not None:
        for token in tokens:
            grammar.feed(token)

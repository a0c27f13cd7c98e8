"""The MTP lane's draws (GPU thread only): the head's draft per row, a prefilled row's first token,
and the speculative-sampling walk that decides a sampling row's verified tokens.

Greedy rows take argmaxes. A sampling row draws its drafts from its processed distribution q
(kept for the walk) and, per verified block, accepts draft d with probability min(1, p(d)/q(d)),
else draws from norm(max(p - q, 0)); each row with its own PRNG key sequence (`RowSampler`), so
the order of the draws below is part of what a seed means. A row with an output grammar draws and
walks on the grammar's masked distributions (`mtp_grammar.py`); its drafts stay the head's. A draft
copied from the row's context is a point mass (`point_logq`): accepted with probability p(d), and a
rejection draws from p with d taken out, which is the same walk.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from mlx_relay.engine.lanes.mtp_grammar import draft_masks
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_rows import MTPRow
from mlx_relay.engine.sampling.processors import GrammarMask
from mlx_relay.engine.sampling.row_sampler import RowSampler, processed_logprobs


def first_token(head: MTPHead, last: mx.array, sampler: RowSampler | None,
                grammar: GrammarMask | None = None) -> mx.array:
    """A prefilled row's first token [1] from the target's last hidden state [1, 1, H] (masked by
    the row's grammar, which has consumed nothing yet)."""
    if sampler is None and grammar is None:
        return head.argmax(last).reshape(1)
    logits = head.logits(last)
    if grammar is not None:
        logits = grammar.masked(logits)
    if sampler is None:
        return mx.argmax(logits, axis=-1).reshape(1)
    logp = processed_logprobs(sampler.params, logits)
    return mx.random.categorical(logp, key=sampler.next_key()).reshape(1)


def propose(head: MTPHead, hidden: mx.array, rows: Sequence[MTPRow]) -> tuple[mx.array, mx.array | None]:
    """Next draft token per row from the head's output hidden [B, 1, H]: argmax for greedy
    rows, a draw from the row's processed distribution q for sampling rows (q kept). With no
    head that drafts: zeros, never verified (the rows' `usable` drafts are their context's)."""
    if not head.drafts:
        return mx.zeros((hidden.shape[0], 1), dtype=mx.int32), None
    if all(r.sampler is None for r in rows):
        return head.argmax(hidden).astype(mx.int32), None  # [B, 1]
    logits = head.logits(hidden)
    toks, logqs = [], []
    for i, r in enumerate(rows):
        if r.sampler is None:
            toks.append(mx.argmax(logits[i], axis=-1).astype(mx.int32))
            logqs.append(mx.zeros((1, logits.shape[-1])))
        else:
            logq = processed_logprobs(r.sampler.params, logits[i])
            toks.append(mx.random.categorical(logq, key=r.sampler.next_key()).astype(mx.int32))
            logqs.append(logq)
    return mx.stack(toks), mx.stack(logqs)


def point_logq(tokens: mx.array, counts: list[int], vocab: int) -> mx.array:
    """log q [B, W, vocab] of drafts copied from the context: a point mass on `tokens[i, j]` for
    j < counts[i] (accepted with probability p(d); a rejection draws from p without d), and
    q = 0 everywhere past them (padding: a walk stopping there draws from p itself)."""
    W = tokens.shape[1]
    real = mx.arange(W)[None, :] < mx.array(counts, dtype=mx.int32)[:, None]  # [B, W]
    hit = mx.arange(vocab)[None, None, :] == tokens[:, :, None]
    return mx.where(hit & real[:, :, None], mx.array(0.0), mx.array(-mx.inf))


def merge_logq(a: mx.array | None, b: mx.array | None, na: int, nb: int) -> mx.array | None:
    """Two cohorts' first-draft log q stacked (zeros for greedy rows); None when neither samples."""
    if a is None and b is None:
        return None
    vocab = (a if a is not None else b).shape[-1]  # type: ignore[union-attr]
    a = a if a is not None else mx.zeros((na, 1, vocab))
    b = b if b is not None else mx.zeros((nb, 1, vocab))
    return mx.concatenate([a, b])


def sampling_walk(head: MTPHead, rows: Sequence[MTPRow], vh: mx.array, drafts: mx.array,
                  logqs: list[mx.array | None], sampled: list[int], k: int,
                  drafts_host: list[list[int]] | None = None) -> tuple[mx.array, mx.array]:
    """Speculative sampling for the sampling rows: per row, flags [k-1] (draft j accepted)
    and tokens [k] (token j is what to emit at j if the walk stops there: the residual draw
    for j < k-1, the bonus draw from p at k-1). A row with a grammar walks its masked
    distributions (`mtp_grammar.draft_masks`, from the drafts read back: `drafts_host`)."""
    idx = mx.array(sampled, dtype=mx.int32)
    logits = head.logits(vh[idx])  # [n, k, V]
    logq = mx.concatenate([q[idx] for q in logqs], axis=1)  # type: ignore[index]  # [n, k-1, V]
    flags, toks = [], []
    for n, i in enumerate(sampled):
        sampler = rows[i].sampler
        assert sampler is not None
        row_logits = logits[n]
        if (grammar := rows[i].grammar) is not None:
            assert drafts_host is not None
            masks = draft_masks(grammar, drafts_host[i], row_logits.shape[-1])
            row_logits = mx.where(masks, row_logits, mx.array(-mx.inf, dtype=row_logits.dtype))
        logp = processed_logprobs(sampler.params, row_logits)  # [k, V]
        d = drafts[i]  # [k-1]
        p_d = mx.take_along_axis(logp[:-1], d[:, None], axis=1)[:, 0]
        q_d = mx.take_along_axis(logq[n], d[:, None], axis=1)[:, 0]
        u = mx.random.uniform(shape=(k - 1,), key=sampler.next_key())
        flags.append(mx.log(u) < p_d - q_d)  # u < p/q  <=>  accept
        residual = mx.maximum(mx.exp(logp[:-1]) - mx.exp(logq[n]), 0.0)
        residual = mx.log(residual)  # -inf where p <= q; categorical normalises
        draws = mx.random.categorical(mx.concatenate([residual, logp[-1:]], axis=0), key=sampler.next_key())
        toks.append(draws.astype(mx.int32))
    return mx.stack(flags), mx.stack(toks)

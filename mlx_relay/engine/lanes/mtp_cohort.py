"""The MTP lane's eager cohort: rows that decode together in mlx-vlm's batch caches, one round
per engine step (GPU thread only; used by `mtp_lane.MTPLane` for sampling rows and rows with an
output grammar, for every row under the exact verifier, and for every row when the compiled round
is off or unsupported).

A round:

1. draft: each row already holds its first draft token (computed by the previous round's MTP
   forward); for block size k > 2 the head drafts k - 2 more, autoregressively;
2. verify: one target forward over ``[bonus, d_1 .. d_{k-1}]`` per row (`mtp_verify`: the exact
   or the batched verifier) inside a speculative cache transaction. Greedy rows take the argmax,
   sampling rows the speculative-sampling walk (`mtp_sampling.sampling_walk`); a row with an
   output grammar walks the grammar's masked logits (`mtp_grammar.py`: the matcher walked through
   the drafts and rolled back, then fed the round's emitted tokens);
3. commit: mlx-vlm's public ``commit_speculative_round`` keeps exactly ``accepted + 1`` positions
   per row (ragged: KV rows are right-trimmed, recurrent states are picked per row);
4. the head re-reads the accepted positions with the target's verified hidden states (one
   forward over ``accepted + 1`` pairs per row, right-padded), which also yields the next
   round's first draft.

One host synchronisation per round (the verified tokens). Rows join merged into the batch caches
and leave by filtering them, so the cohort never stops for newcomers.

Invariant between rounds, per row: the target cache holds every emitted token but the last
(``bonus``); the head's cache holds the pairs ``(h_i, tok_{i+1})`` up to ``(h_last, bonus)``;
``drafts[:, 0]`` is the head's proposal for the token after ``bonus``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.speculative.cache_state import abort_speculative_round, commit_speculative_round

from mlx_relay.engine.lane import MTPCounts
from mlx_relay.engine.lanes.mtp_grammar import feed, greedy_walk
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_rows import MTPRow, RoundResult
from mlx_relay.engine.lanes.mtp_sampling import merge_logq, point_logq, propose, sampling_walk
from mlx_relay.engine.lanes.mtp_verify import Verifier
from mlx_relay.engine.lanes.round_drafts import RoundDrafts
from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches
from mlx_relay.engine.memory.snapshots import Snapshot, snapshot_caches


class EagerCohort:
    def __init__(self, lm: Any, head: MTPHead, verify: Verifier, *, block_size: int, eos: frozenset[int],
                 fallback: bool, max_context: int = 0,
                 always_context: bool = False, weigh_head: bool = True) -> None:
        self.lm = lm
        self.head = head
        self._verify = verify
        self.k = block_size
        self._plans = RoundDrafts(block_size, max_context, min_width=2, always=always_context, weigh_head=weigh_head)
        self.eos = eos
        self._fallback = fallback  # the compiled round is on: every round here is counted as a fallback
        self.rows: list[MTPRow] = []  # in batch order
        self._cache: list[Any] | None = None
        self._dcache: list[Any] | None = None
        self._bonus: mx.array | None = None  # [B] int32
        self._drafts: mx.array | None = None  # [B, 1] first draft token
        self._draft_logq: mx.array | None = None  # [B, 1, V] log q of the first draft (sampling rows)
        self._seed_hidden: mx.array | None = None  # [B, 1, H] head output that proposed drafts[:, 0]
        self._dpos: mx.array | None = None  # [B] next head position per row

    def join(self, row: MTPRow, first: mx.array, draft: mx.array, logq: mx.array | None, seed_h: mx.array) -> None:
        """A prefilled row joins (its batch-1 caches merged into the cohort's)."""
        assert row.pre is not None
        cache, dcache = as_batch_caches(row.pre.cache), as_batch_caches(row.dcache)
        row.pre.cache, row.dcache = [], []
        dpos = mx.array([len(row.prompt)], dtype=mx.int32)
        if not self.rows:
            self._cache, self._dcache = cache, dcache
            self._bonus, self._drafts, self._seed_hidden, self._dpos = first, draft, seed_h, dpos
            self._draft_logq = logq
        else:
            extend_caches([*self._cache, *self._dcache], [*cache, *dcache])  # type: ignore[misc]
            self._bonus = mx.concatenate([self._bonus, first])  # type: ignore[list-item]
            self._drafts = mx.concatenate([self._drafts, draft])  # type: ignore[list-item]
            self._seed_hidden = mx.concatenate([self._seed_hidden, seed_h])  # type: ignore[list-item]
            self._dpos = mx.concatenate([self._dpos, dpos])  # type: ignore[list-item]
            self._draft_logq = merge_logq(self._draft_logq, logq, len(self.rows), 1)
        self.rows.append(row)

    def extract(self, rid: int) -> Snapshot | None:
        """A row's state: every emitted token but the last (target caches only); None: not here."""
        i = next((i for i, r in enumerate(self.rows) if r.rid == rid), None)
        if i is None or self._cache is None:
            return None
        row = self.rows[i]
        caches = [c.extract(i) for c in self._cache]
        length = len(row.prompt) + row.emitted - 1
        entries, nbytes = snapshot_caches(caches, length)
        return Snapshot(length=length, target=entries, nbytes=nbytes)

    def remove(self, rid: int) -> None:
        keep = [i for i, row in enumerate(self.rows) if row.rid != rid]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.clear()
            return
        idx = mx.array(keep, dtype=mx.int32)
        for c in (*self._cache, *self._dcache):  # type: ignore[misc]
            c.filter(idx)
        self._bonus = self._bonus[idx]  # type: ignore[index]
        self._drafts = self._drafts[idx]  # type: ignore[index]
        self._seed_hidden = self._seed_hidden[idx]  # type: ignore[index]
        self._dpos = self._dpos[idx]  # type: ignore[index]
        if self._draft_logq is not None:
            self._draft_logq = self._draft_logq[idx]

    def forget(self) -> None:
        """What the round plans learned of the head from the rows so far is dropped (`RoundDrafts.forget`)."""
        self._plans.forget()

    def clear(self) -> None:
        self.rows = []
        self._cache = self._dcache = self._bonus = self._drafts = None
        self._draft_logq = self._seed_hidden = self._dpos = None

    def round(self) -> RoundResult:
        rows = self.rows
        B, k = len(rows), self.k
        assert self._cache is not None and self._dcache is not None and self._bonus is not None
        assert self._drafts is not None and self._seed_hidden is not None and self._dpos is not None
        plan = self._plans.plan(rows)
        W, host = plan.width, plan.host
        # 1. draft k - 2 more tokens (entries appended here are trimmed after verification)
        drafts, logqs = [self._drafts], [self._draft_logq]
        h, tok = self._seed_hidden, self._drafts
        for j in range(k - 2 if self.head.drafts else 0):
            h = self.head.forward(tok, h, self._dcache, (self._dpos + j)[:, None])
            tok, logq = propose(self.head, h, rows)
            drafts.append(tok)
            logqs.append(logq)
        draft_block = mx.concatenate(drafts, axis=1) if self.head.drafts else mx.zeros((B, k - 1), mx.int32)  # [B, k-1]
        # drafts each row may accept: its context proposal's, or the head's (up to the width)
        usable = [len(host[i]) if host is not None and host[i] else (min(k, W) - 1 if rows[i].use_head else 0)
                  for i in range(B)]
        if host is not None:
            # rows with a context proposal verify it instead (zero-padded to the round's width)
            draft_block, logqs = self._with_context(draft_block, logqs, host, usable, W)
        # 2. verify
        verify_in = mx.concatenate([self._bonus[:, None], draft_block], axis=1)
        vh, txn = self._verify(verify_in, self._cache)
        try:
            targets = self.head.argmax(vh).astype(mx.int32)  # [B, W]
            sampled = [i for i, r in enumerate(rows) if r.sampler is not None]
            # a sampling row's grammar masks its walk at every position: the drafts are read first
            d_pre: list[list[int]] | None = None
            if any(rows[i].grammar is not None for i in sampled):
                d_pre = draft_block.tolist()
            walk = sampling_walk(self.head, rows, vh, draft_block, logqs, sampled, W, d_pre) if sampled else None
            mx.eval(targets, draft_block, walk)
            t_host: list[list[int]] = targets.tolist()
            d_host: list[list[int]] = draft_block.tolist()
            # per row, whether each draft is accepted: equal to the target's argmax (greedy rows; a
            # grammar row's masked argmax, `mtp_grammar.greedy_walk`) or the speculative-sampling
            # draw (sampling rows, whose emitted tokens are the walk's)
            ok = [[d == t for d, t in zip(d_host[i], t_host[i], strict=False)] for i in range(B)]
            if walk is not None:
                w_acc, w_tok = walk[0].tolist(), walk[1].tolist()
                for j, i in enumerate(sampled):
                    t_host[i], ok[i] = w_tok[j], w_acc[j]
            for i, row in enumerate(rows):
                n = usable[i]
                if row.grammar is not None and row.sampler is None:
                    a, token = greedy_walk(row.grammar, self.head, vh[i:i + 1, :n + 1], d_host[i][:n],
                                           t_host[i][:n + 1])
                    ok[i] = [j < a for j in range(W - 1)]
                    t_host[i][a] = token
                ok[i] = [good and j < n for j, good in enumerate(ok[i])]  # padding is never accepted
            accepted = [next((a for a, good in enumerate(flags) if not good), W - 1) for flags in ok]
            replay = [self._cut(rows[i], [*d_host[i][:accepted[i]], t_host[i][accepted[i]]]) for i in range(B)]
            # drafts emitted (a cut replay ends on an accepted draft), and positions committed
            took = [min(a, len(r)) for a, r in zip(accepted, replay, strict=True)]
            accepted = [len(r) - 1 for r in replay]
            for row, emitted in zip(rows, replay, strict=True):
                feed(row.grammar, emitted)
            commit_speculative_round(self.lm, self._cache, txn, accepted, W)
        except BaseException:
            abort_speculative_round(txn)
            raise
        # 3. head: drop this round's draft entries, re-read the accepted pairs with verified hiddens
        last = mx.array(accepted, dtype=mx.int32)
        seed_h = self._reread(replay, accepted, vh, last) if self.head.drafts else self._seed_hidden
        self._dpos = self._dpos + last + 1
        self._bonus = mx.array([r[-1] for r in replay], dtype=mx.int32)
        self._drafts, self._draft_logq = propose(self.head, seed_h, rows)
        self._seed_hidden = seed_h
        mx.async_eval(self._drafts, self._seed_hidden, [c.state for c in (*self._cache, *self._dcache)])
        # 4. emitted tokens (the engine finishes rows on EOS / max_tokens / stop strings)
        result = RoundResult(tokens={}, counts=MTPCounts(rounds=1, fallback_rounds=int(self._fallback),
                                                         wide_rounds=int(W > k)))
        for i, row in enumerate(rows):
            result.tokens[row.rid] = replay[i]
            row.emitted += len(replay[i])
        self._plans.settle(rows, plan, result.tokens, took, result.counts)
        return result

    def _reread(self, replay: list[list[int]], accepted: list[int], vh: mx.array, last: mx.array) -> mx.array:
        """The head drops the round's draft entries and re-reads each row's committed pairs with
        the verified hidden states (right-padded); its output at each row's last one [B, 1, H]."""
        assert self._dcache is not None and self._dpos is not None
        if self.k > 2:
            for c in self._dcache:
                c.trim(self.k - 2)
        a_max = max(accepted)
        width = a_max + 1
        tokens = mx.array([r + [0] * (width - len(r)) for r in replay], dtype=mx.int32)
        right = [a_max - a for a in accepted]
        positions = self._dpos[:, None] + mx.arange(width, dtype=mx.int32)[None, :]
        if any(right):
            for c in self._dcache:
                c.prepare(right_padding=right)
        hh = self.head.forward(tokens, vh[:, :width, :], self._dcache, positions)
        if any(right):
            for c in self._dcache:
                c.finalize()
        return mx.take_along_axis(hh, last[:, None, None], axis=1)

    def _with_context(self, head_block: mx.array, logqs: list[mx.array | None], host: list[list[int]],
                      usable: list[int], W: int) -> tuple[mx.array, list[mx.array | None]]:
        """The round's drafts [B, W-1]: a row's context proposal where it has one, else the head's
        (zero-padded or cut to the width); and their log q as one [B, W-1, V]: a copied draft is
        a point mass, and past a row's `usable` drafts q = 0 everywhere (a walk stopped there by
        force draws from p itself, not from a residual of a draft it never proposed)."""
        B, k = head_block.shape[0], self.k
        mine = mx.array([bool(t) for t in host])[:, None]
        ctx = mx.array([t + [0] * (W - 1 - len(t)) for t in host], dtype=mx.int32)
        head = head_block[:, :W - 1] if W <= k else mx.concatenate(
            [head_block, mx.zeros((B, W - k), mx.int32)], axis=1)
        block = mx.where(mine, ctx, head)
        if all(r.sampler is None for r in self.rows):
            return block, logqs  # greedy rows need no q
        assert self._seed_hidden is not None
        vocab = self.head.logits(self._seed_hidden[:1]).shape[-1]  # a shape: nothing is computed
        hq = mx.concatenate([q if q is not None else mx.zeros((B, 1, vocab)) for q in logqs], axis=1)
        hq = hq[:, :W - 1] if W <= k else mx.concatenate(
            [hq, mx.full((B, W - k, vocab), -mx.inf)], axis=1)
        q = mx.where(mine[:, :, None], point_logq(ctx, [len(t) for t in host], vocab), hq)
        real = mx.arange(W - 1)[None, :] < mx.array(usable, dtype=mx.int32)[:, None]
        return block, [mx.where(real[:, :, None], q, mx.array(-mx.inf))]

    def _cut(self, row: MTPRow, replay: list[int]) -> list[int]:
        """A round's tokens for `row`, ending at its first EOS or at its max_tokens: the tokens
        after either are never emitted, so they are not committed to the caches either (the
        row's state then ends exactly at its last token, which its turn snapshot relies on).
        Cutting after token m keeps m drafts: token m is itself an accepted draft."""
        end = min(len(replay), max(row.max_tokens - row.emitted, 1))
        for m, token in enumerate(replay[:end]):
            if token in self.eos:
                return replay[:m + 1]
        return replay[:end]

"""The text path's MTP speculative decoding under continuous batching (GPU thread only).

A cohort of text-only rows decodes together, one *round* per engine step:

1. draft: each row already holds its first draft token (computed by the previous round's MTP
   forward); for block size k > 2 the head drafts k - 2 more, autoregressively;
2. verify: one batched target forward over ``[bonus, d_1 .. d_{k-1}]`` per row inside a public
   speculative cache transaction (``start_speculative_cache``), which records the GatedDeltaNet
   states per position. ``exact_verify``: through the LanguageModel's speculative-verify call
   (batch-invariant: bit-identical to one-token decode, but on CUDA and CPU every quantized
   linear runs once per row and position); otherwise its ordinary forward (one matmul per
   linear for the whole block). Greedy rows take the argmax, sampling rows the standard speculative-sampling walk
   (accept d with probability min(1, p(d)/q(d)), else draw from norm(max(p - q, 0))),
   each with its own PRNG key;
3. commit: mlx-vlm's public ``commit_speculative_round`` keeps exactly ``accepted + 1`` positions
   per row (ragged: KV rows are right-trimmed, recurrent states are picked per row);
4. the head re-reads the accepted positions with the target's verified hidden states (one
   forward over ``accepted + 1`` pairs per row, right-padded), which also yields the next
   round's first draft.

One host synchronisation per round (the verified tokens).

With `compiled=True` and the batched verifier (`exact_verify=False`: the engine's default off
Metal), greedy rows decode in a cohort of their own whose whole round is one compiled call over
fixed-size state (`mtp_step.MTPStep` over `mtp_state.MTPState`: the accept decision, the cut at
EOS / max_tokens and the commit on device, no speculative cache transaction). Sampling rows,
every row under the exact verifier, and every row of a model `MTPStep` does not support keep the
eager round above (counted in `LaneStep.mtp_fallback_rounds`). Each cohort runs one round per step.

Rows join after their own prefill (each prefilled alone, chunk by chunk, then merged into the
cohort's batch caches) and leave by filtering the caches, so the cohort never stops for newcomers.
Joining rows share the step's prefill budget (`token_budget.fair_shares`): a short prompt is not
held behind a long one's remaining chunks.

Invariant between rounds, per row: the target cache holds every emitted token but the last
(``bonus``); the head's cache holds the pairs ``(h_i, tok_{i+1})`` up to ``(h_last, bonus)``;
``drafts[:, 0]`` is the head's proposal for the token after ``bonus``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx_vlm.speculative.cache_state import (
    abort_speculative_round,
    commit_speculative_round,
    start_speculative_cache,
)

from mlx_relay.engine.lanes.decode_state import batch_bucket
from mlx_relay.engine.lanes.decode_step import UnsupportedModel
from mlx_relay.engine.lanes.lane import LaneStep, RowSpec, RowTokens, ending_of
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_state import MTPState
from mlx_relay.engine.lanes.mtp_step import MTPStep
from mlx_relay.engine.lanes.row_prefill import RowPrefill
from mlx_relay.engine.lanes.stage_forward import StageForward
from mlx_relay.engine.memory.batch_caches import as_batch_caches, batched
from mlx_relay.engine.memory.snapshots import Snapshot, restore_caches, snapshot_caches
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.step.sampling import RowSampler, processed_logprobs
from mlx_relay.engine.step.token_budget import PREFILL_GRANULE, fair_shares


@dataclass
class MTPRow:
    rid: int
    prompt: list[int]
    max_tokens: int
    sampler: RowSampler | None = None  # None: greedy
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    # prefill (rows not yet in the cohort): the target's own prefill, restorable from a snapshot
    pre: RowPrefill | None = None
    dcache: list[Any] = field(default_factory=list)
    carry_hidden: mx.array | None = None  # h_{S-1} of a restored snapshot: pairs with prompt[S]
    snapshots: list[Snapshot] = field(default_factory=list)  # taken during prefill, for the engine

    @property
    def cached_tokens(self) -> int:
        return self.pre.cached_tokens if self.pre is not None else 0


@dataclass
class RoundResult:
    tokens: dict[int, list[int]]  # row -> tokens emitted this step
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0  # eager rounds while the compiled round is on


class MTPLane:
    name: Literal["mtp"] = "mtp"

    def __init__(self, lm: Any, head: MTPHead, *, block_size: int, prefill_step_size: int,
                 eos_token_ids: Sequence[int], exact_verify: bool = True, compiled: bool = True,
                 stage: Stage | None = None) -> None:
        if block_size < 2:
            raise ValueError("MTP block size must be at least 2")
        if stage is not None and exact_verify:
            raise ValueError("a pipeline stage verifies with the batched forward (mlx-vlm's exact verifier runs "
                             "the whole model)")
        self.lm = lm
        # the prefill's and the batched verify's forward: the model, or this pipeline stage of it
        # (which answers every rank the whole model's hidden states)
        self._run: Any = lm if stage is None else StageForward(lm, stage)
        self.head = head
        self.k = block_size
        self.prefill_step_size = prefill_step_size
        self.eos = frozenset(eos_token_ids)
        self.exact_verify = exact_verify
        self.rows: list[MTPRow] = []  # the cohort, in batch order
        self.prefilling_rows: list[MTPRow] = []
        self._cache: list[Any] | None = None
        self._dcache: list[Any] | None = None
        self._bonus: mx.array | None = None  # [B] int32
        self._drafts: mx.array | None = None  # [B, 1] first draft token
        self._draft_logq: mx.array | None = None  # [B, 1, V] log q of the first draft (sampling rows)
        self._seed_hidden: mx.array | None = None  # [B, 1, H] head output that proposed drafts[:, 0]
        self._dpos: mx.array | None = None  # [B] next head position per row
        # the compiled greedy cohort: its rows, in batch order, and its state
        # the compiled round verifies the block with one batched forward, so an exact (batch-
        # invariant) verifier keeps the eager round
        self._step: MTPStep | None = None
        if compiled and not exact_verify:
            try:
                self._step = MTPStep(lm, head, block_size=block_size, eos_token_ids=list(eos_token_ids),
                                     stage=stage)
            except UnsupportedModel:
                self._step = None
        self.compiled = compiled
        self.fast_rows: list[MTPRow] = []
        self._fast: MTPState | None = None

    def __len__(self) -> int:
        return len(self.rows) + len(self.fast_rows) + len(self.prefilling_rows)

    @property
    def has_work(self) -> bool:
        return bool(self.rows) or bool(self.fast_rows) or bool(self.prefilling_rows)

    def _all_rows(self) -> tuple[MTPRow, ...]:
        return (*self.rows, *self.fast_rows, *self.prefilling_rows)

    # -- membership -------------------------------------------------------------------------------
    def add(self, spec: RowSpec) -> None:
        """Queue a row for prefill: from scratch, or from `spec.restore` (its state at the
        snapshot's length; the head's too when the snapshot has it), taking snapshots at
        `spec.snapshot_at`. Every row of the lane verifies `block_size` tokens per round."""
        if spec.block_size != self.k:
            raise ValueError(f"this MTP lane verifies blocks of {self.k}, not {spec.block_size}")
        self._add(MTPRow(rid=spec.rid, prompt=spec.prompt, max_tokens=spec.max_tokens, sampler=spec.sampler),
                  spec.restore, spec.snapshot_at)

    def cached_tokens(self, rid: int) -> int:
        row = next((r for r in self._all_rows() if r.rid == rid), None)
        return row.cached_tokens if row is not None else 0

    def drafts(self, rid: int) -> tuple[int, int]:
        """(drafted, accepted) of a row so far."""
        row = next((r for r in self._all_rows() if r.rid == rid), None)
        return (row.drafted, row.accepted) if row is not None else (0, 0)

    @property
    def decode_tokens(self) -> int:
        """Tokens a round of the cohort verifies: a block per row."""
        return (len(self.rows) + len(self.fast_rows)) * self.k

    @property
    def prefilling(self) -> int:
        return len(self.prefilling_rows)

    def step(self, prefill_budget: int | None = None) -> LaneStep:
        """One round of the cohort, then a prefill chunk of every joining row, the rows sharing
        `prefill_budget` tokens (`token_budget.fair_shares`; None: the oldest row alone, one
        `prefill_step_size` chunk)."""
        out = LaneStep()
        for rows, run in ((self.rows, self.round), (self.fast_rows, self.fast_round)):
            if not rows:
                continue
            result = run()
            out.mtp_rounds += result.rounds
            out.mtp_drafted += result.drafted
            out.mtp_accepted += result.accepted
            out.mtp_fallback_rounds += result.fallback_rounds
            for row in rows:
                tokens = result.tokens.get(row.rid)
                if tokens:
                    out.tokens.append(RowTokens(row.rid, tokens,
                                                ending_of(tokens[-1], row.emitted, row.max_tokens, self.eos)))
        joined, out.prefill_tokens = self.prefill_step(prefill_budget)
        for row in self._all_rows():
            if row.snapshots:
                out.snapshots.extend((row.rid, s) for s in row.snapshots)
                row.snapshots.clear()
        for row, token in joined:
            out.tokens.append(RowTokens(row.rid, [token], ending_of(token, row.emitted, row.max_tokens, self.eos)))
        return out

    def _add(self, row: MTPRow, restore: Snapshot | None, snapshot_at: Sequence[int]) -> None:
        pre = RowPrefill(prompt=row.prompt, cache=self.lm.make_cache())
        row.dcache = self.head.make_cache()
        if restore is not None:
            pre.cache, pre.done = restore_caches(restore.target), restore.length
            pre.cached_tokens = restore.length
            if restore.head is not None and restore.head_hidden is not None:
                row.dcache, row.carry_hidden = restore_caches(restore.head), restore.head_hidden
        pre.snapshot_at = sorted(s for s in snapshot_at if pre.done < s < len(row.prompt))
        row.pre = pre
        self.prefilling_rows.append(row)

    def extract(self, rid: int) -> Snapshot | None:
        """The state of a cohort row: every emitted token but the last (target caches only)."""
        j = next((j for j, r in enumerate(self.fast_rows) if r.rid == rid), None)
        if j is not None and self._fast is not None:
            row = self.fast_rows[j]
            length = len(row.prompt) + row.emitted - 1
            assert self._fast.lengths[j] == length, (self._fast.lengths[j], length)
            entries, nbytes = snapshot_caches(self._fast.row_caches(j), length)
            return Snapshot(length=length, target=entries, nbytes=nbytes)
        i = next((i for i, r in enumerate(self.rows) if r.rid == rid), None)
        if i is None or self._cache is None:
            return None
        row = self.rows[i]
        caches = [c.extract(i) for c in self._cache]
        length = len(row.prompt) + row.emitted - 1
        entries, nbytes = snapshot_caches(caches, length)
        return Snapshot(length=length, target=entries, nbytes=nbytes)

    def remove(self, rid: int) -> None:
        for i, row in enumerate(self.prefilling_rows):
            if row.rid == rid:
                del self.prefilling_rows[i]
                return
        fast_keep = [i for i, row in enumerate(self.fast_rows) if row.rid != rid]
        if len(fast_keep) < len(self.fast_rows):
            self.fast_rows = [self.fast_rows[i] for i in fast_keep]
            if not fast_keep:
                self._fast = None
            else:
                assert self._fast is not None
                self._fast.filter(fast_keep)
            return
        keep = [i for i, row in enumerate(self.rows) if row.rid != rid]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._reset_cohort()
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

    def clear(self) -> None:
        self.rows = []
        self.prefilling_rows = []
        self.fast_rows = []
        self._fast = None
        self._reset_cohort()

    def _reset_cohort(self) -> None:
        self._cache = self._dcache = self._bonus = self._drafts = None
        self._draft_logq = self._seed_hidden = self._dpos = None

    # -- prefill (a chunk of each joining row per call) ---------------------------------------------
    def prefill_step(self, budget: int | None = None) -> tuple[list[tuple[MTPRow, int]], int]:
        """Advance the joining rows: each by a chunk of at most `prefill_step_size` tokens (up to
        its next snapshot length), together at most `budget` tokens, shared fairly (a short row
        takes all it needs, the long ones split the rest); None: the oldest row alone. Returns
        the rows whose prompts are done and have joined the cohort, each with its first token
        (then emitted), and the tokens prefilled."""
        if not self.prefilling_rows:
            return [], 0
        rows = list(self.prefilling_rows)
        needs = []
        for row in rows:
            assert row.pre is not None
            needs.append(row.pre.next_end(self.prefill_step_size) - row.pre.done)
        takes = [needs[0]] + [0] * (len(rows) - 1) if budget is None else fair_shares(needs, budget, PREFILL_GRANULE)
        joined, tokens = [], 0
        for row, take in zip(rows, takes, strict=True):
            if take <= 0:
                continue
            assert row.pre is not None
            tokens += take
            if (first := self._prefill_chunk(row, row.pre.done + take)) is not None:
                joined.append((row, first))
        return joined, tokens

    def _prefill_chunk(self, row: MTPRow, end: int) -> int | None:
        """Prefill prompt[done:end] of a joining row; its first token when its prompt is done
        (it has then joined the cohort)."""
        pre = row.pre
        assert pre is not None
        start = pre.done
        chunk = mx.array([row.prompt[start:end]], dtype=mx.int32)
        out = pre.forward(self._run, end, return_hidden=True, skip_logits=True)
        hidden = out.hidden_states[-1]  # [1, T, H]
        final = pre.finished
        if final:
            last = hidden[:, -1:, :]
            if row.sampler is None:
                first = self.head.argmax(last).reshape(1)
            else:
                logp = processed_logprobs(row.sampler.params, self.head.logits(last))
                first = mx.random.categorical(logp, key=row.sampler.next_key()).reshape(1)
            nxt = mx.concatenate([chunk[:, 1:], first[None, :].astype(mx.int32)], axis=1)
        else:
            nxt = mx.array([row.prompt[start + 1:end + 1]], dtype=mx.int32)
        # the head's pairs (h_i, tok_{i+1}) for i in [start, end), after a restored snapshot's
        # pending pair (h_{start-1}, tok_start)
        h_in, dstart = hidden, start
        if row.carry_hidden is not None:
            h_in = mx.concatenate([row.carry_hidden.astype(hidden.dtype), hidden], axis=1)
            nxt = mx.concatenate([chunk[:, :1], nxt], axis=1)
            dstart, row.carry_hidden = start - 1, None
        dpos = mx.arange(dstart, end, dtype=mx.int32)[None, :]
        h = self.head.forward(nxt, h_in, row.dcache, dpos)
        if pre.wants_snapshot(end):
            target, tbytes = snapshot_caches(pre.cache, end)
            # the head's state too when it covers the whole prefix (not after a restored
            # snapshot without head state); h_{end-1} copied out of the chunk's buffer
            whole = end > 1 and all(c.offset == end for c in row.dcache)
            head, hbytes = snapshot_caches(row.dcache, end - 1) if whole else (None, 0)
            h_last = hidden[:, -1:, :] + 0 if whole else None
            row.snapshots.append(Snapshot(length=end, target=target, head=head, head_hidden=h_last,
                                          nbytes=tbytes + hbytes + (h_last.nbytes if h_last is not None else 0)))
        if not final:
            mx.eval([c.state for c in pre.cache], [c.state for c in row.dcache])
            return None
        self.prefilling_rows.remove(row)
        seed_h = h[:, -1:, :]
        draft, logq = self._propose(seed_h, [row])
        mx.eval(first, draft, [c.state for c in pre.cache], [c.state for c in row.dcache])
        token = int(first.item())
        row.emitted = 1
        self._join(row, first.astype(mx.int32), draft, logq, seed_h)
        return token

    def _join(self, row: MTPRow, first: mx.array, draft: mx.array, logq: mx.array | None, seed_h: mx.array) -> None:
        assert row.pre is not None
        if self._step is not None and row.sampler is None:
            self._join_fast(row, first, draft, seed_h)
            return
        cache, dcache = as_batch_caches(row.pre.cache), as_batch_caches(row.dcache)
        row.pre.cache, row.dcache = [], []
        dpos = mx.array([len(row.prompt)], dtype=mx.int32)
        if not self.rows:
            self._cache, self._dcache = cache, dcache
            self._bonus, self._drafts, self._seed_hidden, self._dpos = first, draft, seed_h, dpos
            self._draft_logq = logq
        else:
            for mine, theirs in zip((*self._cache, *self._dcache), (*cache, *dcache), strict=True):  # type: ignore[misc]
                mine.extend(theirs)
            self._bonus = mx.concatenate([self._bonus, first])  # type: ignore[list-item]
            self._drafts = mx.concatenate([self._drafts, draft])  # type: ignore[list-item]
            self._seed_hidden = mx.concatenate([self._seed_hidden, seed_h])  # type: ignore[list-item]
            self._dpos = mx.concatenate([self._dpos, dpos])  # type: ignore[list-item]
            self._draft_logq = self._merge_logq(self._draft_logq, logq, len(self.rows), 1)
        self.rows.append(row)

    def _join_fast(self, row: MTPRow, first: mx.array, draft: mx.array, seed_h: mx.array) -> None:
        """A greedy row joins the compiled cohort (its library caches copied once)."""
        assert row.pre is not None and self._step is not None
        state = MTPState.from_row(row.pre.cache, row.dcache, self._step.layout, first, draft, seed_h,
                                  dpos=len(row.prompt))
        row.pre.cache, row.dcache = [], []
        if self._fast is None:
            state.pad_to_bucket()
            self._fast = state
        else:
            self._fast.extend(state)
        self.fast_rows.append(row)

    def warm_rounds(self, max_rows: int) -> int:
        """Trace the compiled round at every batch size its cohort can run at (idle rows from a
        one-token prefill), so no request meets a first-shape compile; returns how many sizes."""
        if self._step is None:
            return 0
        sizes = sorted({batch_bucket(n) for n in range(1, max_rows + 1)})
        for size in sizes:
            state: MTPState | None = None
            for _ in range(size):
                cache, dcache = self.lm.make_cache(), self.head.make_cache()
                out = self.lm(mx.array([[0]]), cache=cache, return_hidden=True, skip_logits=True)
                seed = self.head.forward(mx.array([[0]]), out.hidden_states[-1], dcache, mx.array([[0]]))
                zero = mx.zeros((1,), dtype=mx.int32)
                row = MTPState.from_row(cache, dcache, self._step.layout, zero, zero, seed, dpos=1)
                if state is None:
                    state = row
                else:
                    state.extend(row)
            assert state is not None
            state.pad_to_bucket()
            out_round = self._step(state, [1] * size)
            mx.eval(out_round.targets, out_round.committed, state.arrays())
        return len(sizes)

    def _merge_logq(self, a: mx.array | None, b: mx.array | None, na: int, nb: int) -> mx.array | None:
        if a is None and b is None:
            return None
        vocab = (a if a is not None else b).shape[-1]  # type: ignore[union-attr]
        a = a if a is not None else mx.zeros((na, 1, vocab))
        b = b if b is not None else mx.zeros((nb, 1, vocab))
        return mx.concatenate([a, b])

    def _propose(self, hidden: mx.array, rows: list[MTPRow]) -> tuple[mx.array, mx.array | None]:
        """Next draft token per row from the head's output hidden [B, 1, H]: argmax for greedy
        rows, a draw from the row's processed distribution q for sampling rows (q kept)."""
        if all(r.sampler is None for r in rows):
            return self.head.argmax(hidden).astype(mx.int32), None  # [B, 1]
        logits = self.head.logits(hidden)
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

    # -- one round ------------------------------------------------------------------------------------
    def round(self) -> RoundResult:
        rows = self.rows
        B, k = len(rows), self.k
        assert self._cache is not None and self._dcache is not None and self._bonus is not None
        assert self._drafts is not None and self._seed_hidden is not None and self._dpos is not None
        # 1. draft k - 2 more tokens (entries appended here are trimmed after verification)
        drafts, logqs = [self._drafts], [self._draft_logq]
        h, tok = self._seed_hidden, self._drafts
        for j in range(k - 2):
            h = self.head.forward(tok, h, self._dcache, (self._dpos + j)[:, None])
            tok, logq = self._propose(h, rows)
            drafts.append(tok)
            logqs.append(logq)
        draft_block = mx.concatenate(drafts, axis=1)  # [B, k-1]
        # 2. verify
        verify_in = mx.concatenate([self._bonus[:, None], draft_block], axis=1)
        vh, txn = self._verify(verify_in)
        try:
            targets = self.head.argmax(vh).astype(mx.int32)  # [B, k]
            sampled = [i for i, r in enumerate(rows) if r.sampler is not None]
            walk = self._sampling_walk(vh, draft_block, logqs, sampled) if sampled else None
            mx.eval(targets, draft_block, walk)
            t_host: list[list[int]] = targets.tolist()
            d_host: list[list[int]] = draft_block.tolist()
            # per row, whether each draft is accepted: equal to the target's argmax (greedy rows)
            # or the speculative-sampling draw (sampling rows, whose emitted tokens are the walk's)
            ok = [[d == t for d, t in zip(d_host[i], t_host[i], strict=False)] for i in range(B)]
            if walk is not None:
                w_acc, w_tok = walk[0].tolist(), walk[1].tolist()
                for j, i in enumerate(sampled):
                    t_host[i], ok[i] = w_tok[j], w_acc[j]
            accepted = [next((a for a, good in enumerate(flags) if not good), k - 1) for flags in ok]
            replay = [self._cut(rows[i], [*d_host[i][:accepted[i]], t_host[i][accepted[i]]]) for i in range(B)]
            # drafts emitted (a cut replay ends on an accepted draft), and positions committed
            took = [min(a, len(r)) for a, r in zip(accepted, replay, strict=True)]
            accepted = [len(r) - 1 for r in replay]
            commit_speculative_round(self.lm, self._cache, txn, accepted, k)
        except BaseException:
            abort_speculative_round(txn)
            raise
        # 3. head: drop this round's draft entries, re-read the accepted pairs with verified hiddens
        if k > 2:
            for c in self._dcache:
                c.trim(k - 2)
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
        last = mx.array(accepted, dtype=mx.int32)
        seed_h = mx.take_along_axis(hh, last[:, None, None], axis=1)  # [B, 1, H]
        self._dpos = self._dpos + last + 1
        self._bonus = mx.array([r[-1] for r in replay], dtype=mx.int32)
        self._drafts, self._draft_logq = self._propose(seed_h, rows)
        self._seed_hidden = seed_h
        mx.async_eval(self._drafts, self._seed_hidden, [c.state for c in (*self._cache, *self._dcache)])
        # 4. emitted tokens (the engine finishes rows on EOS / max_tokens / stop strings)
        result = RoundResult(tokens={}, rounds=1, fallback_rounds=int(self.compiled))
        for i, row in enumerate(rows):
            row.drafted += k - 1
            row.accepted += took[i]
            result.drafted += k - 1
            result.accepted += took[i]
            result.tokens[row.rid] = replay[i]
            row.emitted += len(replay[i])
        return result

    def fast_round(self) -> RoundResult:
        """One compiled round of the greedy cohort; one host synchronisation (the counts)."""
        rows, state, step = self.fast_rows, self._fast, self._step
        assert state is not None and step is not None
        k = self.k
        room = [max(r.max_tokens - r.emitted, 1) for r in rows]
        out = step(state, room)
        # the counts first, then the rest of the round (commit, the head's next draft) in a second
        # batch that runs while the host emits this round's tokens
        mx.async_eval(out.targets, out.accepted, out.committed)
        mx.async_eval(state.arrays())
        targets: list[list[int]] = out.targets.tolist()
        accepted: list[int] = out.accepted.tolist()
        committed: list[int] = out.committed.tolist()
        step.advance(state, committed)
        result = RoundResult(tokens={}, rounds=1)
        for i, row in enumerate(rows):
            m = committed[i]
            took = min(accepted[i], m + 1)
            row.drafted += k - 1
            row.accepted += took
            result.drafted += k - 1
            result.accepted += took
            result.tokens[row.rid] = targets[i][:m + 1]
            row.emitted += m + 1
        return result

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

    def _verify(self, block: mx.array) -> tuple[mx.array, Any]:
        """The target's last hidden states over `block` [B, k] and the open cache transaction."""
        deltas = mx.zeros((block.shape[0], 1), dtype=mx.int32)
        if self.exact_verify:
            out = self.lm(block, cache=self._cache, speculative_verify=True, return_hidden=True,
                          return_shared_kv=True, skip_logits=True, rope_deltas=deltas)
            return out.hidden_states[-1], out.gdn_states
        txn = start_speculative_cache(self._cache, block.shape[1])
        try:
            # one forward for the whole batch: the model's per-row path would run over re-merged
            # (untracked) caches
            out = self._run(block, cache=self._cache,
                            **batched(return_hidden=True, skip_logits=True, rope_deltas=deltas))
        except BaseException:
            abort_speculative_round(txn)
            raise
        return out.hidden_states[-1], txn

    def _sampling_walk(self, vh: mx.array, drafts: mx.array, logqs: list[mx.array | None],
                       sampled: list[int]) -> tuple[mx.array, mx.array]:
        """Speculative sampling for the sampling rows: per row, flags [k-1] (draft j accepted)
        and tokens [k] (token j is what to emit at j if the walk stops there: the residual draw
        for j < k-1, the bonus draw from p at k-1)."""
        idx = mx.array(sampled, dtype=mx.int32)
        logits = self.head.logits(vh[idx])  # [n, k, V]
        logq = mx.concatenate([q[idx] for q in logqs], axis=1)  # type: ignore[index]  # [n, k-1, V]
        flags, toks = [], []
        for n, i in enumerate(sampled):
            sampler = self.rows[i].sampler
            assert sampler is not None
            logp = processed_logprobs(sampler.params, logits[n])  # [k, V]
            d = drafts[i]  # [k-1]
            p_d = mx.take_along_axis(logp[:-1], d[:, None], axis=1)[:, 0]
            q_d = mx.take_along_axis(logq[n], d[:, None], axis=1)[:, 0]
            u = mx.random.uniform(shape=(self.k - 1,), key=sampler.next_key())
            flags.append(mx.log(u) < p_d - q_d)  # u < p/q  <=>  accept
            residual = mx.maximum(mx.exp(logp[:-1]) - mx.exp(logq[n]), 0.0)
            residual = mx.log(residual)  # -inf where p <= q; categorical normalises
            draws = mx.random.categorical(mx.concatenate([residual, logp[-1:]], axis=0), key=sampler.next_key())
            toks.append(draws.astype(mx.int32))
        return mx.stack(flags), mx.stack(toks)

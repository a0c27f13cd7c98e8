"""The MTP lane's joining rows: each prefilled alone, chunk by chunk, into batch-1 caches of the
target and of the head (GPU thread only; used by `mtp_lane.MTPLane`).

A row starts from scratch or from a prefix snapshot (the target's state, and the head's when the
snapshot has it), takes snapshots at its snapshot lengths (the prompt's end included: the state
its last chunk leaves, before the first token is drawn), and once its prompt is done draws its
first token and the head's first draft and is handed to the lane (`on_done`), which merges it
into a cohort. Joining rows share the step's prefill budget shortest first (`token_budget.shortest_first`):
a short prompt is not held behind a long one's remaining chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from mlx_relay.engine.lanes.mtp_grammar import feed
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_rows import MTPRow
from mlx_relay.engine.lanes.mtp_sampling import first_token, propose
from mlx_relay.engine.lanes.row_prefill import RowPrefill
from mlx_relay.engine.memory.snapshots import Snapshot, restore_caches, snapshot_caches
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import fresh_caches
from mlx_relay.engine.scheduling.token_budget import PREFILL_GRANULE, shortest_first

#: A row whose prompt is done: (row, its first token [1], the head's first draft [1, 1], that
#: draft's log q (sampling rows), the head's hidden state that proposed it [1, 1, H]).
OnDone = Callable[[MTPRow, mx.array, mx.array, "mx.array | None", mx.array], None]


class MTPPrefill:
    def __init__(self, lm: Any, run: Any, head: MTPHead, prefill_step_size: int,
                 kv_quant: KVQuant | None = None) -> None:
        self.kv_quant = kv_quant
        self.lm = lm
        self._run = run  # the prefill's forward: the model, or this pipeline stage of it
        self.head = head
        self.prefill_step_size = prefill_step_size
        self.rows: list[MTPRow] = []

    def _head_pairs(self, row: MTPRow, chunk: mx.array, nxt: mx.array, hidden: mx.array, start: int,
                    end: int) -> mx.array:
        """The head over the chunk's pairs (h_i, tok_{i+1}) for i in [start, end), after a restored
        snapshot's pending pair (h_{start-1}, tok_start): its output hidden states."""
        h_in, dstart = hidden, start
        if row.carry_hidden is not None:
            h_in = mx.concatenate([row.carry_hidden.astype(hidden.dtype), hidden], axis=1)
            nxt = mx.concatenate([chunk[:, :1], nxt], axis=1)
            dstart, row.carry_hidden = start - 1, None
        dpos = mx.arange(dstart, end, dtype=mx.int32)[None, :]
        return self.head.forward(nxt, h_in, row.dcache, dpos)

    def add(self, row: MTPRow, restore: Snapshot | None, snapshot_at: Sequence[int]) -> None:
        pre = RowPrefill(prompt=row.prompt, cache=fresh_caches(self.lm, self.lm.make_cache(), self.kv_quant))
        row.dcache = self.head.make_cache()
        if restore is not None:
            pre.cache, pre.done = restore_caches(restore.target), restore.length
            pre.cached_tokens = restore.length
            if self.head.drafts and restore.head is not None and restore.head_hidden is not None:
                row.dcache, row.carry_hidden = restore_caches(restore.head), restore.head_hidden
        pre.snapshot_at = sorted(s for s in snapshot_at if pre.done < s <= len(row.prompt))
        row.pre = pre
        self.rows.append(row)

    def remove(self, rid: int) -> bool:
        for i, row in enumerate(self.rows):
            if row.rid == rid:
                del self.rows[i]
                return True
        return False

    def finishing_costs(self) -> list[int]:
        """Each joining row's tokens to the end of its prompt (each is prefilled alone: no padding),
        for the rows one chunk can finish."""
        left = [len(row.prompt) - row.pre.done for row in self.rows if row.pre is not None]
        return [n for n in left if n <= self.prefill_step_size]

    def step(self, budget: int | None, on_done: OnDone) -> tuple[list[tuple[MTPRow, int]], int]:
        """Advance the joining rows: each by a chunk of at most `prefill_step_size` tokens (up to
        its next snapshot length), together at most `budget` tokens, shortest first (a row that
        fits takes all it needs, the long ones split the rest); None: the oldest row alone. Returns
        the rows whose prompts are done (each handed to `on_done` as it finished), each with its
        first token (then emitted), and the tokens prefilled."""
        if not self.rows:
            return [], 0
        rows = list(self.rows)
        needs = []
        for row in rows:
            assert row.pre is not None
            needs.append(row.pre.next_end(self.prefill_step_size) - row.pre.done)
        takes = [needs[0]] + [0] * (len(rows) - 1) if budget is None else shortest_first(needs, budget, PREFILL_GRANULE)
        joined, tokens = [], 0
        for row, take in zip(rows, takes, strict=True):
            if take <= 0:
                continue
            assert row.pre is not None
            tokens += take
            if (first := self._chunk(row, row.pre.done + take, on_done)) is not None:
                joined.append((row, first))
        return joined, tokens

    def _chunk(self, row: MTPRow, end: int, on_done: OnDone) -> int | None:
        """Prefill prompt[done:end] of a joining row; its first token when its prompt is done
        (it has then been handed to `on_done`)."""
        pre = row.pre
        assert pre is not None
        start = pre.done
        chunk = mx.array([row.prompt[start:end]], dtype=mx.int32)
        out = pre.forward(self._run, end, return_hidden=True, skip_logits=True)
        hidden = out.hidden_states[-1]  # [1, T, H]
        final = pre.finished
        if final:
            first = first_token(self.head, hidden[:, -1:, :], row.sampler, row.grammar)
            nxt = mx.concatenate([chunk[:, 1:], first[None, :].astype(mx.int32)], axis=1)
        else:
            nxt = mx.array([row.prompt[start + 1:end + 1]], dtype=mx.int32)
        h = self._head_pairs(row, chunk, nxt, hidden, start, end) if self.head.drafts else hidden
        if pre.wants_snapshot(end):
            target, tbytes = snapshot_caches(pre.cache, end)
            # the head's state too when it covers the whole prefix (not after a restored
            # snapshot without head state); h_{end-1} copied out of the chunk's buffer
            whole = self.head.drafts and end > 1 and all(c.offset == end for c in row.dcache)
            head, hbytes = snapshot_caches(row.dcache, end - 1) if whole else (None, 0)
            h_last = hidden[:, -1:, :] + 0 if whole else None
            row.snapshots.append(Snapshot(length=end, target=target, head=head, head_hidden=h_last,
                                          nbytes=tbytes + hbytes + (h_last.nbytes if h_last is not None else 0)))
        if not final:
            mx.eval([c.state for c in pre.cache], [c.state for c in row.dcache])
            return None
        self.rows.remove(row)
        seed_h = h[:, -1:, :]
        draft, logq = propose(self.head, seed_h, [row])
        mx.eval(first, draft, [c.state for c in pre.cache], [c.state for c in row.dcache])
        token = int(first.item())
        feed(row.grammar, [token])
        row.emitted = 1
        on_done(row, first.astype(mx.int32), draft, logq, seed_h)
        return token

"""The MTP lane's compiled cohort: greedy rows whose whole round is one compiled call over
fixed-size state (GPU thread only; used by `mtp_lane.MTPLane` with `compiled=True` and the
batched verifier, the engine's default off Metal).

`mtp_step.MTPStep` over `mtp_state.MTPState`: the drafts, the verify forward, the accept
decision, the cut at EOS / max_tokens and the commit run on device, with no speculative cache
transaction; one host synchronisation per round (the counts). A row joins with its library
caches copied once into the state, and leaves by filtering it.

Rounds of one token (no row takes the head's drafts and no context proposal is worth verifying:
rows whose drafts miss) are pipelined like the plain lane's steps: the next one is launched before
the last one is read, since each row commits exactly its one token. The round in flight is read
(drained) before anything changes the batch; a row that ended in the round read last has one
token too many in the state, so its turn snapshot takes the GatedDeltaNet states from before the
round in flight (`_InFlight.before`). Its context proposals are scored when its token is read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_relay.engine.lane import MTPCounts
from mlx_relay.engine.lanes.decode_state import batch_bucket
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_rows import MTPRow, RoundResult
from mlx_relay.engine.lanes.mtp_state import MTPState
from mlx_relay.engine.lanes.mtp_step import HostDrafts, MTPStep, RoundOut
from mlx_relay.engine.lanes.round_drafts import RoundDrafts, RoundPlan
from mlx_relay.engine.memory.snapshots import Snapshot, snapshot_caches
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import fresh_caches


@dataclass
class _InFlight:
    """A one-token round launched and not read yet."""

    out: RoundOut
    rows: list[MTPRow]
    before: tuple[list[mx.array], list[mx.array]]  # the GatedDeltaNet states it started from (conv, ssm)


class CompiledCohort:
    def __init__(self, step: MTPStep, *, block_size: int, max_context: int = 0,
                 always_context: bool = False) -> None:
        # a pipeline stage's ranks must run the same rounds: no width chosen by timing
        weigh_head = step.stage is None
        self._step = step
        self.k = block_size
        # rounds of the head's blocks 2 .. block_size, by the rows' measured acceptance (issue 45.3)
        self._plans = RoundDrafts(block_size, max_context, min_width=1, always=always_context, weigh_head=weigh_head,
                                  min_block=2)
        self.rows: list[MTPRow] = []  # in batch order
        self._state: MTPState | None = None
        self._flight: _InFlight | None = None
        self._carry: dict[int, list[int]] = {}  # tokens read by a drain, emitted by the next round
        self._carry_counts = MTPCounts()
        self._last_read = time.perf_counter()
        # a pipelined round's time is the interval between two reads: one that held other work of
        # the engine step (a joining row's prefill chunk) is not its cost, and is not recorded
        self._untimed = False

    def other_work(self) -> None:
        """The engine step ran other work after this cohort's round (the lane's prefill): the
        interval to the next read is not a round's cost."""
        self._untimed = True

    def join(self, row: MTPRow, first: mx.array, draft: mx.array, seed_h: mx.array) -> None:
        """A greedy row joins (its library caches copied once)."""
        assert row.pre is not None
        self._drain()
        state = MTPState.from_row(row.pre.cache, row.dcache, self._step.layout, first, draft, seed_h,
                                  dpos=len(row.prompt))
        row.pre.cache, row.dcache = [], []
        if self._state is None:
            state.pad_to_bucket()
            self._state = state
        else:
            self._state.extend(state)
        self.rows.append(row)

    def extract(self, rid: int) -> Snapshot | None:
        """A row's state: every emitted token but the last (target caches only); None: not here."""
        j = next((j for j, r in enumerate(self.rows) if r.rid == rid), None)
        if j is None or self._state is None:
            return None
        row, state = self.rows[j], self._state
        length = len(row.prompt) + row.emitted - 1
        if self._flight is not None:
            # a round in flight has fed the row one more token: its GatedDeltaNet states from before
            # it (the keys beyond `length` are not copied)
            assert state.lengths[j] == length + 1, (state.lengths[j], length)
            caches = state.row_caches(j, length, *self._flight.before)
        else:
            assert state.lengths[j] == length, (state.lengths[j], length)
            caches = state.row_caches(j)
        entries, nbytes = snapshot_caches(caches, length)
        return Snapshot(length=length, target=entries, nbytes=nbytes)

    def remove(self, rid: int) -> bool:
        """Whether the row was here (then it has left)."""
        keep = [i for i, row in enumerate(self.rows) if row.rid != rid]
        if len(keep) == len(self.rows):
            return False
        self._drain()
        self._carry.pop(rid, None)
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._state = None
        else:
            assert self._state is not None
            self._state.filter(keep)
        return True

    def forget(self) -> None:
        """What the round plans learned of the head from the rows so far is dropped (`RoundDrafts.forget`)."""
        self._plans.forget()

    def clear(self) -> None:
        self.rows = []
        self._state = None
        self._flight = None
        self._carry, self._carry_counts = {}, MTPCounts()

    # -- one-token rounds, pipelined --------------------------------------------------------------
    def _pipelines(self, plan: RoundPlan) -> bool:
        """Whether this round is a one-token round that may be launched before the last is read:
        nothing to verify, and every row may emit a token more than the one in flight."""
        if plan.width != 1 or plan.host is None or any(plan.host):
            return False
        pending = 1 if self._flight is not None else 0
        return all(r.max_tokens - r.emitted >= 1 + pending for r in self.rows)

    def _launch(self) -> _InFlight:
        state = self._state
        assert state is not None
        n = len(self.rows)
        before = (state.conv, state.ssm)
        out = self._step(state, [1] * n, HostDrafts(1, [[]] * n, [False] * n))
        mx.async_eval(out.targets, state.arrays())
        self._step.advance(state, [0] * n)  # each row commits its one token
        return _InFlight(out, list(self.rows), before)

    def _read(self, flight: _InFlight, tokens: dict[int, list[int]], counts: MTPCounts) -> None:
        """A one-token round's tokens (its rows' contexts scored for them, as if proposed)."""
        targets: list[list[int]] = flight.out.targets.tolist()
        rows, n = flight.rows, len(flight.rows)
        # free proposals are scored against the tokens read; a costly one (a draft model's) is not made
        free = [{j: h.propose(r.max_context) for j, h in enumerate(r.hosts) if not h.costly} for r in rows]
        plan = RoundPlan(1, [[] for _ in rows], [False] * n, started=self._last_read, heads=[False] * n,
                         timed=not self._untimed, free=free)
        self._untimed = False
        emitted = {}
        for i, row in enumerate(rows):
            emitted[row.rid] = [targets[i][0]]
            tokens.setdefault(row.rid, []).append(targets[i][0])
            row.emitted += 1
        counts.rounds += 1
        counts.pipelined_rounds += 1
        self._plans.settle(rows, plan, emitted, [0] * n, counts)
        self._last_read = time.perf_counter()

    def _drain(self) -> None:
        """Read the round in flight (its tokens go out with the next round)."""
        if self._flight is not None:
            flight, self._flight = self._flight, None
            self._read(flight, self._carry, self._carry_counts)

    def _ended(self, row: MTPRow, tokens: list[int] | None) -> bool:
        """Whether `tokens` (a row's, read by a drain) end it: its last allowed, or end-of-sequence."""
        if not tokens:
            return False
        return row.emitted >= row.max_tokens or any(t in self._step.eos_token_ids for t in tokens)

    def _carried(self) -> RoundResult:
        result = RoundResult(tokens=self._carry, counts=self._carry_counts)
        self._carry, self._carry_counts = {}, MTPCounts()
        return result

    def round(self) -> RoundResult:
        """One compiled round; one host synchronisation (the counts). A one-token round is
        launched before the one in flight is read (whose tokens it returns)."""
        rows, state, step = self.rows, self._state, self._step
        assert state is not None
        result = self._carried()
        if any(self._ended(row, result.tokens.get(row.rid)) for row in rows):
            # a drain (a row joining or leaving) read the round that ended a row: its tokens go out
            # alone, so the lane ends the row before it is given a token past its end
            return result
        plan = self._plans.plan(rows)
        if self._pipelines(plan):
            if self._flight is None:
                self._last_read = time.perf_counter()  # the cadence starts here
            flight, self._flight = self._flight, self._launch()
            if flight is not None:
                self._read(flight, result.tokens, result.counts)
            return result
        if self._flight is not None:
            # the contexts have moved on since this plan: read what is in flight, plan next step
            self._drain()
            carried = self._carried()
            for rid, toks in carried.tokens.items():
                result.tokens.setdefault(rid, []).extend(toks)
            result.counts.add(carried.counts)
            return result
        host = plan.host
        room = [max(r.max_tokens - r.emitted, 1) for r in rows]
        # the head drafts the round's block - 1 tokens (a round wider than the block: the whole block's)
        block = plan.width if any(plan.heads) and 2 <= plan.width <= self.k else None
        out = step(state, room, None if host is None else HostDrafts(plan.width, host, plan.heads), block=block)
        # the counts first, then the rest of the round (commit, the head's next draft) in a second
        # batch that runs while the host emits this round's tokens
        mx.async_eval(out.targets, out.accepted, out.committed)
        mx.async_eval(state.arrays())
        targets: list[list[int]] = out.targets.tolist()
        accepted: list[int] = out.accepted.tolist()
        committed: list[int] = out.committed.tolist()
        step.advance(state, committed)
        result.counts.rounds += 1
        result.counts.wide_rounds += int(plan.width > self.k)
        took = []
        emitted = {}
        for i, row in enumerate(rows):
            m = committed[i]
            took.append(min(accepted[i], m + 1))
            emitted[row.rid] = targets[i][:m + 1]
            result.tokens.setdefault(row.rid, []).extend(targets[i][:m + 1])
            row.emitted += m + 1
        self._plans.settle(rows, plan, emitted, took, result.counts)
        self._last_read, self._untimed = time.perf_counter(), False
        return result

    def _variants(self, size: int, drafter: bool) -> list[tuple[HostDrafts | None, int | None]]:
        """The rounds a cohort of `size` can run, (drafts, block): with the head (each of its blocks;
        wide, with context drafts) and, where rows can go without it, the head-free one (one token;
        wide)."""
        wide = self._plans.wide if self._plans.max_context else None
        out: list[tuple[HostDrafts | None, int | None]] = []
        if drafter:
            out.extend((None, b) for b in self._plans.blocks)
            if wide is not None:
                out.append((HostDrafts(wide, [[0]] * size, [True] * size), None))
        if not drafter or wide is not None:
            out.append((HostDrafts(1, [[]] * size, [False] * size), None))
            if wide is not None:
                out.append((HostDrafts(wide, [[0]] * size, [False] * size), None))
        return out

    def warm(self, lm: Any, head: MTPHead, max_rows: int, kv_quant: KVQuant | None = None) -> int:
        """Trace the compiled round at every batch size the cohort can run at (idle rows from a
        one-token prefill), so no request meets a first-shape compile; returns how many sizes."""
        sizes = sorted({batch_bucket(n) for n in range(1, max_rows + 1)})
        for size in sizes:
            state: MTPState | None = None
            for _ in range(size):
                cache, dcache = fresh_caches(lm, lm.make_cache(), kv_quant), head.make_cache()
                out = lm(mx.array([[0]]), cache=cache, return_hidden=True, skip_logits=True)
                hidden = out.hidden_states[-1]
                seed = head.forward(mx.array([[0]]), hidden, dcache, mx.array([[0]])) if head.drafts else hidden
                zero = mx.zeros((1,), dtype=mx.int32)
                row = MTPState.from_row(cache, dcache, self._step.layout, zero, zero, seed, dpos=1)
                if state is None:
                    state = row
                else:
                    state.extend(row)
            assert state is not None
            state.pad_to_bucket()
            for drafts, block in self._variants(size, head.drafts):
                out_round = self._step(state, [1] * size, drafts, block=block)
                mx.eval(out_round.targets, out_round.committed, state.arrays())
        return len(sizes)

"""A cohort round's drafts from the rows' contexts, chosen by what they earn (GPU thread, no MLX;
used by both MTP cohorts, `mtp_cohort.EagerCohort` and `mtp_compiled.CompiledCohort`).

Before a round, `RoundDrafts.plan` asks each row that takes context drafts for a proposal
(`speculation.context_drafts`), and picks the round's width: the head's block `k` (each row
verifies the head's drafts), the head off (`min_width`: one token a row in the compiled cohort,
weighed once the cohort has verified `HEAD_OFF_AFTER` of the head's drafts, each row's expected
from what the head earned on the cohort's rows so far until its own are measured, and run where what
they earn is worth less than the wider round costs: a head that misses, or any head once the batch
is bound by its arithmetic, where a round of k positions a row costs about k steps) or
`1 + max_context` (rows whose proposal is expected to beat the head's verify it instead),
whichever yields more expected tokens per second over all rows at the widths' measured round
times (`speculation.earnings`; a width not chosen is timed again every `PROBE_EVERY` rounds, so a
head switched off is verified, and measured, now and then). After the round, `settle` credits each
source with what was accepted: verified for the source the row used, shadowed for a context
proposal it did not, and feeds the emitted tokens to the row's context.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlx_relay.engine.lane import MTPCounts
from mlx_relay.engine.lanes.decode_state import batch_bucket
from mlx_relay.engine.lanes.mtp_rows import MTPRow
from mlx_relay.engine.speculation.earnings import LaneTally, RoundCosts, agreed


@dataclass
class RoundPlan:
    """One round's drafts: its width and, per row, its host proposal (of the row's proposers, the one
    expected to yield the most) and whether it is verified."""

    width: int
    proposals: list[list[int]]  # per row: its host proposal (maybe empty)
    use_context: list[bool]  # per row: the round verifies its proposal (else the head's drafts)
    started: float = field(default_factory=time.perf_counter)  # the round's time runs from here
    heads: list[bool] = field(default_factory=list)  # per row: it takes the head's drafts
    timed: bool = True  # its time (from `started` to its settling) is the round's alone: recorded
    chosen: list[int] = field(default_factory=list)  # per row: whose proposal (`MTPRow.hosts`; -1: none)
    free: list[dict[int, list[int]]] = field(default_factory=list)  # per row: the free proposals made, by proposer

    @property
    def host(self) -> list[list[int]] | None:
        """Per row the drafts the host gives the round (empty: the head's, or none for a row that
        does not take them); None: the head's for every row."""
        if not any(self.use_context) and all(self.heads):
            return None
        return [p if use else [] for p, use in zip(self.proposals, self.use_context, strict=True)]


#: the head is weighed against one token a row (by the two widths' measured round times) once
#: the cohort verified this many of its drafts: one head miss against the prior does not start
#: switching widths (a switch from pipelined one-token rounds to the head's costs a step without a
#: token). A round without the head leaves the head's own cache without that position:
#: `FIRST_SAMPLES` such rounds to time it, then one a `PROBE_EVERY` rounds where the head stays on.
#: Weighing it only while its drafts earned under half a draft kept a head that agrees 0.92 on at 16
#: rows of a CPU bound by its arithmetic, at 0.58x plain decoding; weighing it only once each row had
#: its own 16 drafts verified kept a missing head on every new row of 16 short requests: 0.47x plain
#: on an H200 at c=16 (benchmarks/results/speculation-batch-cpu-2026-11-28/, gpu-h200-2026-11-28d/).
HEAD_OFF_AFTER = 16


def _pick(row: MTPRow) -> tuple[int, list[int], dict[int, list[int]]]:
    """The row's host proposal: of its proposers' (a free one made now, a costly one promised at full
    length), the one expected to add the most tokens; (its proposer, it, the free ones made)."""
    best, proposal, expected, free = -1, [], 0.0, {}
    for j, host in enumerate(row.hosts):
        if host.costly and not host.ready():  # catching up with the row's tokens: no proposal this round
            continue
        p = [0] * row.max_context if host.costly else host.propose(row.max_context)
        if not host.costly:
            free[j] = p
        e = row.earnings.expected(host.source, len(p)) if p else 0.0
        if p and (best < 0 or e > expected):
            best, proposal, expected = j, p, e
    return best, proposal, free


def _made(rows: Sequence[MTPRow], proposals: list[list[int]], chosen: list[int], use: list[bool]) -> list[list[int]]:
    """The proposals with each costly one made where the round verifies it (else none)."""
    out = []
    for r, p, j, u in zip(rows, proposals, chosen, use, strict=True):
        if j >= 0 and r.hosts[j].costly:
            p = r.hosts[j].propose(r.max_context) if u else []
        out.append(p)
    return out


def _expected(row: MTPRow, j: int, proposal: list[int]) -> float:
    """Tokens `row`'s host proposal (of its proposer `j`) adds, expected (by what its source earned on the row)."""
    return row.earnings.expected(row.hosts[j].source, len(proposal))


class RoundDrafts:
    def __init__(self, block_size: int, max_context: int, min_width: int, always: bool = False,
                 weigh_head: bool = True, min_block: int | None = None) -> None:
        self.k = block_size
        # the head's blocks a round may run at (`min_block` .. `block_size`: the compiled round's, chosen
        # by the rows' measured acceptance at each block's measured time; else the block alone)
        self.blocks = range(block_size if min_block is None else max(2, min_block), block_size + 1)
        self.always = always  # verify every proposal (no expectation, no timing)
        self.weigh_head = weigh_head  # the head may be off for a round (not in a pipeline)
        self.max_context = max_context  # the lane's longest context proposal (0: none)
        self.min_width = min_width  # a round's width when no row drafts (the compiled round: 1)
        self.costs = RoundCosts()
        self.head_tally = LaneTally()  # the head's drafts over the cohort's rows: a new row's prior

    def forget(self) -> None:
        """Drop what the cohort's rows measured of the head (the warm-up's rows are not traffic);
        the widths' round times stay."""
        self.head_tally = LaneTally()

    @property
    def wide(self) -> int:
        return 1 + self.max_context

    def plan(self, rows: Sequence[MTPRow]) -> RoundPlan:
        started = time.perf_counter()  # the round's time counts its proposals (a draft model's forwards)
        n = len(rows)
        heads = [r.use_head for r in rows]
        # the width without context drafts: the head's block, or one token (plus padding up to
        # `min_width`) when no row takes the head's drafts
        k = self.k if any(heads) else self.min_width
        # a free proposal is made every round; a costly one (a draft model's) is first promised at
        # full length, and made only if the round then verifies it
        picks = [_pick(r) for r in rows]
        chosen, proposals, free = [p[0] for p in picks], [p[1] for p in picks], [p[2] for p in picks]
        prior = self.head_tally.prior
        head = [1.0 + (r.earnings.expected("mtp", k - 1, prior) if r.use_head else 0.0) for r in rows]
        # the widths worth timing: the head's block; the head off for the round (one token a row,
        # where a head whose drafts miss costs more than it earns); the context drafts' width
        options = {k: sum(head)}
        if self._weighs_head(heads, k):
            options[self.min_width] = float(n)
            # shorter blocks: fewer head drafts a row, at their own measured time (not the context's width)
            for b in self.blocks:
                if b < k and b != self.wide:
                    options[b] = sum(1.0 + (r.earnings.expected("mtp", b - 1, prior) if r.use_head else 0.0)
                                     for r in rows)
        use = [False] * n
        if self.max_context > 0 and any(proposals):
            use = [bool(p) and (self.always or 1.0 + _expected(r, j, p) > h)
                   for r, j, p, h in zip(rows, chosen, proposals, head, strict=True)]
            if any(use) and self.wide > k:
                if self.always:
                    return RoundPlan(self.wide, _made(rows, proposals, chosen, use), use, started, heads=heads,
                                     chosen=chosen, free=free)
                options[self.wide] = sum(1.0 + _expected(r, j, p) if u else h
                                         for r, j, p, u, h in zip(rows, chosen, proposals, use, head, strict=True))
        width = k if len(options) == 1 else self.costs.best_width(batch_bucket(n), options)
        # the head's block (or a shorter one); context drafts no longer than it ride in it
        head_round = width == k or (any(heads) and width in self.blocks)
        verified = width == self.wide and self.wide in options and self.wide != self.min_width
        if head_round and self.wide <= width:
            verified = True
        made = _made(rows, proposals, chosen, use if verified else [False] * n)
        if verified:
            use = [u and bool(p) for u, p in zip(use, made, strict=True)]
        if head_round:
            return RoundPlan(width, made, use if self.wide <= width else [False] * n, started, heads=heads,
                             chosen=chosen, free=free)
        if verified:
            return RoundPlan(width, made, use, started, heads=heads, chosen=chosen, free=free)
        # the head off this round
        return RoundPlan(width, made, [False] * n, started, heads=[False] * n, chosen=chosen, free=free)

    def _weighs_head(self, heads: list[bool], k: int) -> bool:
        """Whether this round weighs the head off: where rounds may differ in width by their timing
        (not a pipeline: its ranks must choose alike), once the cohort verified `HEAD_OFF_AFTER` of
        the head's drafts."""
        if not (self.weigh_head and any(heads) and self.min_width < k and not self.always):
            return False
        return self.head_tally.drafted >= HEAD_OFF_AFTER

    def settle(self, rows: Sequence[MTPRow], plan: RoundPlan, emitted: dict[int, list[int]], took: list[int],
               counts: MTPCounts) -> None:
        """After the round: `emitted[rid]` its tokens, `took[i]` the drafts row i had accepted."""
        if plan.timed:
            self.costs.record(batch_bucket(len(rows)), plan.width, time.perf_counter() - plan.started)
        head: list[tuple[int, int]] = []
        for i, row in enumerate(rows):
            tokens = emitted.get(row.rid, [])
            proposal = plan.proposals[i]
            j = plan.chosen[i] if plan.chosen else -1
            verified = plan.use_context[i] and j >= 0
            if verified:
                source = row.hosts[j].source
                row.earnings.record(source, len(proposal), took[i], verified=True)
                counts.add_host(source, len(proposal), took[i])
            elif row.use_head:
                n = min(self.k, plan.width) - 1
                row.earnings.record("mtp", n, took[i], verified=True)
                head.append((n, took[i]))
                counts.drafted += n
                counts.accepted += took[i]
            for jj, p in (plan.free[i].items() if plan.free else ()):
                if p and tokens and not (verified and jj == j):
                    # unverified, a free proposal is scored against what the row emitted (a proposal
                    # longer than the round's tokens: only as far as they go)
                    row.earnings.record(row.hosts[jj].source, min(len(p), len(tokens)), agreed(p, tokens),
                                        verified=False)
            for host in row.hosts:
                host.extend(tokens)
        if head:
            self.head_tally.record_round(head)

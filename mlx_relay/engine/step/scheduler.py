"""The engine's scheduler (GPU thread, no MLX): which rows run, in which lane, this step.

Rows wait in arrival order. Each step, rows whose SpecPrefill scoring is due move to the scoring
stage (they hold no decode slot while the draft reads them), then waiting rows join while fewer
than `max_num_seqs` run, each in one lane for its whole life:
- `mtp`: the TextMTPExecutor planned speculation for it (the head's drafts, its context's, or both)
  at the lane's block size, and fewer than
  `mtp_max_batch` rows are running (a round costs more than a plain step, more so as the batch
  grows: MTP pays only for (nearly) lone rows);
- `plain`: every other row (our own prefill: restorable, snapshottable);
- `kv`: every row, where the engine runs that one lane (a model served through its library's forward).
A row joins only when its caches fit beside the running rows' (`memory.kv_budget.KVBudget.fits`,
each row reserved at its prompt plus its `max_tokens`); otherwise it and every row after it wait
(first come, first served) until rows end, rather than run the device out of memory.
The plan is a typed value; the engine executes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlx_relay.engine.lane import LaneName
from mlx_relay.engine.memory.kv_budget import KVBudget
from mlx_relay.engine.step.rows import Row


def reserved_tokens(row: Row) -> int:
    """The tokens a row's caches may come to hold: its prompt and its reply's longest."""
    return len(row.req.prompt_tokens) + row.req.sampling.max_tokens


@dataclass
class StepPlan:
    joins: list[Row] = field(default_factory=list)  # rows joining a lane (`row.lane` set)
    to_score: list[Row] = field(default_factory=list)  # rows entering the scoring stage


class Scheduler:
    def __init__(self, *, max_num_seqs: int, mtp_block: int | None, mtp_max_batch: int,
                 budget: KVBudget | None = None, sole: LaneName | None = None) -> None:
        self.sole = sole  # the engine's one lane, where it runs one (a model served through its library's forward)
        self.max_num_seqs = max_num_seqs
        self.budget = budget  # the device's memory for the rows' caches (None: not counted)
        self.memory_waits = 0  # steps in which the next row waited for memory
        self.mtp_block = mtp_block  # the MTP lane's block size (None: no MTP lane)
        self.mtp_max_batch = mtp_max_batch
        self.waiting: deque[Row] = deque()
        self.running: dict[int, Row] = {}

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, row: Row, *, first: bool = False) -> None:
        """A new row waits last; a row back from scoring (it has waited already) first."""
        if first:
            self.waiting.appendleft(row)
        else:
            self.waiting.append(row)

    def remove(self, rid: int) -> Row | None:
        row = self.running.pop(rid, None)
        if row is None:
            for waiting in self.waiting:
                if waiting.rid == rid:
                    self.waiting.remove(waiting)
                    return waiting
        return row

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if any(row.wants_scoring for row in self.waiting):
            plan.to_score = [row for row in self.waiting if row.wants_scoring]
            self.waiting = deque(row for row in self.waiting if not row.wants_scoring)
        while self.waiting and len(self.running) < self.max_num_seqs:
            if not self._fits(self.waiting[0]):
                self.memory_waits += 1
                break
            row = self.waiting.popleft()
            row.lane = self._lane_for(row)
            self.running[row.rid] = row
            plan.joins.append(row)
        return plan

    def _fits(self, row: Row) -> bool:
        """Whether `row`'s caches fit beside the running rows' (alone it always runs: the service
        refuses a row that cannot fit alone)."""
        if self.budget is None or not self.running:
            return True
        return self.budget.fits([*(reserved_tokens(r) for r in self.running.values()), reserved_tokens(row)])

    def _lane_for(self, row: Row) -> LaneName:
        if self.sole is not None:
            return self.sole
        plan = row.req.speculate
        if plan is not None and plan.block_size == self.mtp_block and len(self.running) < self.mtp_max_batch:
            return "mtp"
        return "plain"

"""SpecPrefill's scoring stage of the engine (GPU thread only): where the draft model lives.

A row whose Generate carries a `ScorePlan` waits here before it joins a lane: the draft scores
the uncached part of its prompt one chunk per engine step (oldest row first; running rows keep
decoding meanwhile), then `specprefill.selection.select_chunks` (a pure function) picks the
chunks the target prefills, first those `specprefill.anchors.anchor_chunks` finds for the plan's
anchor rule (runs of prompt tokens that the query repeats). The outcome is the row's `sparse`
selection and its report; anything that goes wrong with the draft (it fails, the scores are not
finite, the lengths disagree) leaves the row to be prefilled in full with a report saying why.
The SpecPrefillScorer actor decided that the row is scored, how much is kept and by which anchor
rule; it gets the outcome for its statistics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_relay.engine.scoring.draft_scorer import DraftScorer, ScoringJob
from mlx_relay.engine.step.rows import Row
from mlx_relay.messages.gpu import DraftInfo
from mlx_relay.messages.specprefill import ScoringOutcome, SpecPrefillReport
from mlx_relay.runtime.supervision import is_failure
from mlx_relay.specprefill.anchors import anchor_chunks
from mlx_relay.specprefill.selection import select_chunks

log = logging.getLogger(__name__)


@dataclass
class _Job:
    row: Row
    job: ScoringJob | None  # None: it could not start (the row leaves at the next step)
    started: float
    error: str | None = None


class ScoringStage:
    def __init__(self, draft_path: str | None, tokenizer: Any, prefill_step_size: int) -> None:
        self._draft = DraftScorer.load(Path(draft_path), tokenizer) if draft_path is not None else None
        self._chunk = prefill_step_size
        self._jobs: dict[int, _Job] = {}  # row -> its job, oldest first

    @property
    def draft(self) -> DraftInfo | None:
        return self._draft.info if self._draft is not None else None

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, row: Row) -> None:
        plan = row.req.score
        assert plan is not None
        entry = _Job(row, None, time.perf_counter())
        try:
            if self._draft is None:
                raise RuntimeError("no SpecPrefill draft model is loaded")
            entry.job = self._draft.start(row.req.prompt_tokens[plan.dense_end:], chunk=self._chunk,
                                          window=plan.window)
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            entry.error = f"{type(exc).__name__}: {exc}"
        self._jobs[row.rid] = entry

    def cancel(self, rid: int) -> None:
        entry = self._jobs.pop(rid, None)
        if entry is not None and entry.job is not None:
            entry.job.close()

    def clear(self) -> None:
        for rid in list(self._jobs):
            self.cancel(rid)

    def step(self) -> tuple[Row, ScoringOutcome] | None:
        """One draft chunk of the oldest job; the row and its outcome when the job is done (the
        row's `sparse` and `specprefill` are then set)."""
        if not self._jobs:
            return None
        rid, entry = next(iter(self._jobs.items()))
        scores: list[float] | None = None
        if entry.error is None:
            assert entry.job is not None
            try:
                scores = entry.job.step()
            except BaseException as exc:
                if not is_failure(exc):  # native panics are failures too; control flow is not
                    raise
                log.warning("SpecPrefill scoring of %s failed: %s", entry.row.req.request_id, exc)
                entry.error = f"{type(exc).__name__}: {exc}"
            if entry.error is None and scores is None:
                return None  # more chunks to go
        del self._jobs[rid]
        if entry.job is not None:
            entry.job.close()
        return entry.row, self._select(entry, scores)

    def _select(self, entry: _Job, scores: list[float] | None) -> ScoringOutcome:
        row = entry.row
        plan = row.req.score
        assert plan is not None
        n = len(row.req.prompt_tokens) - plan.dense_end
        error = entry.error
        if error is None and scores is not None and len(scores) != n:
            error = f"the draft returned {len(scores)} scores for {n} tokens"
        if error is not None or scores is None:
            row.specprefill = SpecPrefillReport(False, 0, n, plan.keep_fraction, fallback=error or "no scores")
        else:
            rule = plan.anchor
            anchors = frozenset() if rule is None else anchor_chunks(
                row.req.prompt_tokens, start=plan.dense_end, chunk_size=plan.chunk_size, rule=rule)
            picked = select_chunks(scores, start=plan.dense_end, chunk_size=plan.chunk_size,
                                   keep_fraction=plan.keep_fraction, anchors=anchors,
                                   anchor_share=1.0 if rule is None else rule.max_share)
            row.sparse = picked.sparse
            row.specprefill = SpecPrefillReport(
                True, n, picked.sparse.kept - plan.dense_end, plan.keep_fraction,
                anchor_ngram=0 if rule is None else rule.ngram, anchored_chunks=picked.anchored,
                anchors_rescued=picked.rescued, anchors_dropped=picked.dropped)
        return ScoringOutcome(row.req.request_id, row.specprefill, time.perf_counter() - entry.started, row.sparse)

"""SpecPrefillScorer: decides which long prompts are prefilled sparsely, and keeps the counts.

    ChatService --PlanSpecPrefill--> scorer --> SpecPrefillDecision
        due (the uncached part's length against the threshold, or the request's own override):
        a ScorePlan, which the request's Generate carries to the GPUExecutor; there the draft
        model scores the uncached tokens one chunk per engine step (other requests keep decoding
        meanwhile), the chunks are selected (`specprefill.selection`, a pure function; first the
        anchors of the plan's rule, `specprefill.anchors`: the request's n-gram length or the
        server's) and the kept tokens prefilled, all in one visit (`engine/scoring/stage.py`)
    GPUExecutor --ScoringOutcome--> scorer: what the selection kept (and anchored), or why it fell back

Anything that goes wrong with scoring (the draft fails, the scores are not finite, the lengths
disagree) falls back to a normal prefill for that request, reported in its usage and counted
here. The draft model itself is loaded by the GPUExecutor from the same `SpecPrefillConfig`.
"""

from __future__ import annotations

from mlx_relay.config import SpecPrefillConfig
from mlx_relay.messages.specprefill import (
    GetSpecPrefillStats,
    PlanSpecPrefill,
    ScorePlan,
    ScoringOutcome,
    SparsePrefill,
    SpecPrefillDecision,
    SpecPrefillReport,
    SpecPrefillStats,
)
from mlx_relay.runtime import Actor, ReplyStream
from mlx_relay.specprefill.anchors import anchor_rule


class SpecPrefillScorer(Actor):
    accepts = (PlanSpecPrefill, ScoringOutcome, GetSpecPrefillStats)
    mailbox_capacity = 4096  # every ScoringOutcome should fit: far more than requests in flight

    def __init__(self, config: SpecPrefillConfig) -> None:
        if config.draft_model is None:
            raise ValueError("SpecPrefillScorer needs a draft model")
        self.config = config
        self._sparse = self._fallbacks = self._scored = self._kept = 0
        self._seconds = 0.0
        self._last_error: str | None = None
        self._anchors = [0, 0, 0]  # chunks anchored, of them rescued, anchors dropped

    async def receive(self, msg: PlanSpecPrefill | ScoringOutcome | GetSpecPrefillStats,
                      stream: ReplyStream | None) -> object:
        match msg:
            case PlanSpecPrefill():
                return self.decide(msg)
            case ScoringOutcome():
                self._outcome(msg)
                return None
            case GetSpecPrefillStats():
                c = self.config
                return SpecPrefillStats(str(c.draft_model), c.threshold, c.chunk_size, c.keep_fraction, self._sparse,
                                        self._fallbacks, self._scored, self._kept, round(self._seconds, 4),
                                        self._last_error, c.anchor_ngram, *self._anchors)
        raise TypeError(type(msg).__name__)

    def _dense_end(self, msg: PlanSpecPrefill) -> int:
        """Where the scored part starts: after the restored prefix and after each snapshot point
        that still leaves enough to score (the threshold; when forced, more than two chunks)."""
        c = self.config
        least = c.threshold if msg.enabled is None else 2 * c.chunk_size + 1
        points = [s for s in msg.snapshot_at if msg.prompt_tokens - s >= least]
        return max([msg.restored, *points])

    def decide(self, msg: PlanSpecPrefill) -> SpecPrefillDecision:
        c = self.config
        dense = self._dense_end(msg)
        n = msg.prompt_tokens - dense
        due = msg.enabled if msg.enabled is not None else n >= c.threshold
        if not due or n <= 0:
            return SpecPrefillDecision()
        keep = msg.keep_fraction if msg.keep_fraction is not None else c.keep_fraction
        if keep >= 1.0:  # nothing to drop: the sparse path with every position (no scoring)
            self._count(0, n, 0.0)
            return SpecPrefillDecision(sparse=SparsePrefill([(0, msg.prompt_tokens)]),
                                       report=SpecPrefillReport(True, 0, n, keep))
        if n <= 2 * c.chunk_size:  # first and last chunk are always kept: nothing could be dropped
            return SpecPrefillDecision(report=SpecPrefillReport(
                False, 0, n, keep, fallback=f"the uncached prompt ({n} tokens) is within two chunks"))
        return SpecPrefillDecision(score=ScorePlan(dense, keep, c.chunk_size, c.query_window,
                                                   anchor_rule(c, msg.anchor_ngram)))

    def _outcome(self, out: ScoringOutcome) -> None:
        report = out.report
        if report.fallback is not None:
            self._fallbacks += 1
            self._last_error = report.fallback
            return
        self._count(report.scored_tokens, report.kept_tokens, out.seconds)
        for i, n in enumerate((report.anchored_chunks, report.anchors_rescued, report.anchors_dropped)):
            self._anchors[i] += n

    def _count(self, scored: int, kept: int, seconds: float) -> None:
        self._sparse += 1
        self._scored += scored
        self._kept += kept
        self._seconds += seconds

"""Messages of the SpecPrefillScorer (`actors/specprefill_scorer.py`): it decides per request
whether the uncached part of a long prompt is scored and how much of it is kept; the GPUExecutor
scores it with the draft model where the draft lives, selects the chunks (a pure function,
`specprefill.selection`) and prefills them in one visit, then reports the outcome."""

from __future__ import annotations

import msgspec

from mlx_relay.specprefill.report import SpecPrefillReport

__all__ = ["AnchorRule", "GetSpecPrefillStats", "PlanSpecPrefill", "ScorePlan", "ScoringOutcome", "SparsePrefill",
           "SpecPrefillDecision", "SpecPrefillReport", "SpecPrefillStats"]


class SparsePrefill(msgspec.Struct, frozen=True):
    """The prompt positions the target prefills: ascending, disjoint [start, end) ranges; every
    position before `ranges[0][1]` (the cached prefix and any snapshot point) is kept."""

    ranges: list[tuple[int, int]]

    @property
    def kept(self) -> int:
        return sum(b - a for a, b in self.ranges)


class AnchorRule(msgspec.Struct, frozen=True):
    """Chunks kept ahead of the scores (`specprefill.anchors`): those holding a run of `ngram`
    prompt tokens that also occurs in the query (the prompt's last `query_tokens` tokens), or the
    `follow` tokens after it, unless that run occurs more than `max_occurrences` times before the
    query (boilerplate); they take at most `max_share` of the keep budget (`specprefill.selection`)."""

    ngram: int
    query_tokens: int
    max_occurrences: int
    follow: int = 0  # tokens after an occurrence that it anchors too (what a name is followed by)
    max_share: float = 1.0

    def __post_init__(self) -> None:
        if self.ngram < 1 or self.query_tokens < self.ngram or self.max_occurrences < 1 or self.follow < 0:
            raise ValueError("AnchorRule needs ngram >= 1, query_tokens >= ngram, max_occurrences >= 1 "
                             "and follow >= 0")
        if not 0.0 < self.max_share <= 1.0:
            raise ValueError("AnchorRule.max_share must be in (0, 1]")


class ScorePlan(msgspec.Struct, frozen=True):
    """How the GPU executor scores and selects: the draft scores `tokens[dense_end:]` (the
    attention of the last `window` query positions), chunks of `chunk_size` are kept by
    `keep_fraction`, the chunks `anchor` names first (None: by the scores alone); everything
    before `dense_end` is kept unscored."""

    dense_end: int
    keep_fraction: float
    chunk_size: int
    window: int
    anchor: AnchorRule | None = None


class PlanSpecPrefill(msgspec.Struct, frozen=True):
    """Ask: what SpecPrefill does for `tokens`. Reply: SpecPrefillDecision.

    `restored`: the prompt tokens the prefix cache restores (never scored). `snapshot_at`: the
    prompt lengths the prefix cache wants exact snapshots at; the ones that still leave a long
    enough part to score (e.g. a system prompt's end) stay exact, later ones (e.g. the reply's
    header, for the conversation's next turn) are given up for the sparse prefill.
    `enabled`: the request's override (None: by the threshold). `keep_fraction` and
    `anchor_ngram` (0: no anchors): its own (None: the server's)."""

    request_id: str
    prompt_tokens: int
    restored: int = 0
    snapshot_at: list[int] = []
    enabled: bool | None = None
    keep_fraction: float | None = None
    anchor_ngram: int | None = None


class SpecPrefillDecision(msgspec.Struct, frozen=True):
    """`score`: scored on the GPU (the report comes with the reply's Finished). Otherwise `sparse`
    (a selection made without scoring, or None: every token) and `report` (None: neither due
    nor asked for)."""

    score: ScorePlan | None = None
    sparse: SparsePrefill | None = None
    report: SpecPrefillReport | None = None


class ScoringOutcome(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> scorer): how a scored request went (`report.fallback`: it failed and
    the prompt was prefilled in full)."""

    request_id: str
    report: SpecPrefillReport
    seconds: float = 0.0  # GPU-thread time from the first draft chunk to the selection
    sparse: SparsePrefill | None = None  # the selection (None: it fell back to a full prefill)


class GetSpecPrefillStats(msgspec.Struct, frozen=True):
    """Ask. Reply: SpecPrefillStats."""


class SpecPrefillStats(msgspec.Struct, frozen=True):
    draft_model: str
    threshold: int
    chunk_size: int
    keep_fraction: float
    sparse_requests: int  # prefilled sparsely
    fallbacks: int  # due, but scoring failed: prefilled normally
    tokens_scored: int
    tokens_kept: int
    scoring_seconds: float  # GPU-thread time from first draft chunk to scores, summed
    last_error: str | None = None
    anchor_ngram: int = 0  # the server's anchor n-gram (0: no anchors unless a request asks)
    chunks_anchored: int = 0  # chunks kept as anchors (`SpecPrefillReport.anchored_chunks`), summed
    anchors_rescued: int = 0  # of those, the ones the scores alone would have dropped
    anchors_dropped: int = 0  # anchor chunks the keep budget had no room for

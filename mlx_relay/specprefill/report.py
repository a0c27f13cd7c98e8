"""What SpecPrefill did for one request: carried from the scorer through the engine's Finished
to the reply's usage (shared by the engine messages and the parsed reply events)."""

from __future__ import annotations

import msgspec


class SpecPrefillReport(msgspec.Struct, frozen=True, omit_defaults=True):
    """What SpecPrefill did for one request (reported back in its usage; zero fields left out)."""

    ran: bool  # the prompt was prefilled sparsely
    scored_tokens: int = 0  # uncached prompt tokens the draft model scored
    kept_tokens: int = 0  # of those, the ones the target prefilled
    keep_fraction: float = 0.0  # the fraction asked for
    fallback: str | None = None  # why it did not run although it was asked for or due
    anchor_ngram: int = 0  # the anchor rule's n-gram length (0: no anchors; `specprefill.anchors`)
    anchored_chunks: int = 0  # chunks kept because they share an n-gram with the query (first/last aside)
    anchors_rescued: int = 0  # of those, the ones the draft's scores alone would have dropped
    anchors_dropped: int = 0  # anchor chunks the keep budget had no room for (the lowest-scored)

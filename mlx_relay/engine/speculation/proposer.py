"""What a row's drafts made on the host look like to the MTP lane's round plan (no MLX of its own;
`lanes/round_drafts.py` asks it before each round): drafts copied from the row's context
(`context_drafts.ContextDrafts`) or a draft model's (`draft_model.DraftProposals`,
`draft_compiled.CompiledDraftProposals`), and how much of a row's tokens a costly one reads a round."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from mlx_relay.engine.speculation.earnings import Source

#: the most of a row's tokens a costly proposer (a draft model) reads in one round: a long prompt
#: over several rounds, so that no round, and no other row's decoding, waits on its whole prefill
FEED_CHUNK = 2048


class Proposer(Protocol):
    #: the earnings' source its drafts are credited to
    source: Source
    #: a proposal costs model calls: made only for a round that will verify it (a free one is made
    #: every round, and scored against what the row wrote when it is not verified)
    costly: bool

    def ready(self) -> bool:
        """Whether it can propose this round (a costly one may first catch up with the row's tokens,
        a bounded piece a round)."""
        ...

    def propose(self, k: int) -> list[int]:
        """Up to `k` drafts after the row's committed tokens (none: nothing worth verifying)."""
        ...

    def extend(self, tokens: Iterable[int]) -> None:
        """The row committed `tokens`."""
        ...

"""One row of the MTP lane, and what a round of a cohort returns (GPU thread only).

A row is prefilling (`mtp_prefill.MTPPrefill`: its own batch-1 caches, `pre`, `dcache`) until its
prompt is done, then decodes in one of the lane's two cohorts (`mtp_cohort.EagerCohort`,
`mtp_compiled.CompiledCohort`), which hold its state in their batch; the row keeps its counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_relay.engine.lane import MTPCounts
from mlx_relay.engine.lanes.row_prefill import RowPrefill
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.sampling.processors import GrammarMask
from mlx_relay.engine.sampling.row_sampler import RowSampler
from mlx_relay.engine.speculation.context_drafts import ContextDrafts
from mlx_relay.engine.speculation.draft_model import DraftModel
from mlx_relay.engine.speculation.earnings import Earnings
from mlx_relay.engine.speculation.proposer import Proposer


@dataclass
class MTPRow:
    rid: int
    prompt: list[int]
    max_tokens: int
    sampler: RowSampler | None = None  # None: greedy
    grammar: GrammarMask | None = None  # the output grammar, applied inside the round (`mtp_grammar.py`)
    emitted: int = 0
    use_head: bool = True  # the head's drafts (False: the row verifies only context drafts)
    max_context: int = 0  # host drafts per round at most (0: none)
    drafter: DraftModel | None = None  # host drafts from this draft model too
    copy_drafts: bool = True  # host drafts copied from the row's context (with `drafter`: too)
    hosts: list[Proposer] = field(default_factory=list)  # the row's host drafts' proposers, once it joins
    earnings: Earnings = field(default_factory=Earnings)
    # prefill (rows not yet in the cohort): the target's own prefill, restorable from a snapshot
    pre: RowPrefill | None = None
    dcache: list[Any] = field(default_factory=list)
    carry_hidden: mx.array | None = None  # h_{S-1} of a restored snapshot: pairs with prompt[S]
    snapshots: list[Snapshot] = field(default_factory=list)  # taken during prefill, for the engine

    @property
    def cached_tokens(self) -> int:
        return self.pre.cached_tokens if self.pre is not None else 0


    @property
    def drafted(self) -> int:
        """Drafts verified so far, every source."""
        return sum(t.drafted for t in self.earnings.tallies.values())

    @property
    def accepted(self) -> int:
        return sum(t.accepted for t in self.earnings.tallies.values())

    def start_context(self, first: int) -> None:
        """The row's host drafts from its prompt and first token: the draft model's proposals and/or
        its context indexed, as it takes them."""
        if self.max_context <= 0:
            return
        tokens = [*self.prompt, first]
        if self.drafter is not None:
            self.hosts.append(self.drafter.proposals(tokens))
        if self.copy_drafts or self.drafter is None:
            self.hosts.append(ContextDrafts(tokens))


@dataclass
class RoundResult:
    tokens: dict[int, list[int]]  # row -> tokens emitted this step
    counts: MTPCounts

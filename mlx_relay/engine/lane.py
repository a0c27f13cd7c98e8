"""The interface every decode lane implements, and the typed values a lane step returns
(GPU thread only).

A lane decodes a set of rows in one batch: `add` queues a row (from scratch or restored from a
snapshot, with snapshot points), `step` runs one decode step of its joined rows and then prefill
chunks of its joining rows within the step's prefill budget (`scheduling/token_budget.py`; the engine gives
each lane its share after counting `decode_tokens` of every lane), `extract` copies a row's
whole state (its turn snapshot), `remove` lets a row go, `clear` drops everything (after a
failed step). Three lanes exist:
`lanes/mtp_lane.MTPLane` (text rows with MTP speculative decoding) and `lanes/plain_lane.PlainLane` (our own
restorable prefill, then our compiled decode step); a model of no family of ours runs
`lanes/kv_lane.KVLane` alone (its library's forward over KV caches).

A lane reports each row's new tokens and, where the lane knows it (end-of-sequence, max_tokens),
that the row's sequence ended; the output stage adds stop strings and finishes rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import mlx.core as mx

from mlx_relay.engine.memory.snapshot_codec import CacheLayout
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.sampling.processors import GrammarMask
from mlx_relay.engine.sampling.row_sampler import RowSampler
from mlx_relay.messages.specprefill import SparsePrefill

#: How a lane ended a row's sequence: end-of-sequence ("stop") or its last allowed token ("length").
SequenceEnd = Literal["stop", "length"]


@dataclass
class RowSpec:
    """What a lane needs to start a row."""

    rid: int
    prompt: list[int]  # the tokens to prefill (a sparse row: only the kept ones)
    max_tokens: int
    processors: list[Any] = field(default_factory=list)  # logits processors, the sampler last
    sampler: RowSampler | None = None  # the MTP lane samples itself (its rows have no processors)
    grammar: GrammarMask | None = None  # ... and applies an output grammar inside its round
    restore: Snapshot | None = None
    snapshot_at: Sequence[int] = ()
    embeds: mx.array | None = None  # [1, L, D]: vision rows (features merged in)
    positions: mx.array | None = None  # [3, 1, L]: M-RoPE positions (vision and sparse rows)
    rope_delta: int = 0  # decode position = index + rope_delta
    block_size: int = 2  # MTP rows: tokens per verify round
    use_head: bool = True  # MTP rows: the head drafts (else only context drafts, where they match)
    context_drafts: int = 0  # MTP rows: at most this many drafts copied from the context per round (0: none)
    draft_model: bool = False  # MTP rows: ... made by the lane's draft model too (`context_drafts` of them)
    copy_drafts: bool = True  # MTP rows: ... copied from the context (off: the draft model's alone)


@dataclass
class RowTokens:
    rid: int
    tokens: list[int]
    ended: SequenceEnd | None = None  # the lane ended the sequence with the last of `tokens`


@dataclass
class MTPCounts:
    """MTP rounds and their drafts: of one round, one lane step, or the engine's whole life."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0  # rounds run eagerly while the compiled round is on
    context_drafted: int = 0  # drafts copied from the rows' contexts, verified
    context_accepted: int = 0
    draft_drafted: int = 0  # a draft model's drafts, verified
    draft_accepted: int = 0
    wide_rounds: int = 0  # rounds run at the host drafts' width (the context's, a draft model's)
    pipelined_rounds: int = 0  # one-token rounds run pipelined (each launched before the last was read)

    def add(self, other: MTPCounts) -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.fallback_rounds += other.fallback_rounds
        self.context_drafted += other.context_drafted
        self.context_accepted += other.context_accepted
        self.draft_drafted += other.draft_drafted
        self.draft_accepted += other.draft_accepted
        self.wide_rounds += other.wide_rounds
        self.pipelined_rounds += other.pipelined_rounds

    def add_host(self, source: str, drafted: int, accepted: int) -> None:
        """Verified host drafts of `source` ("context", or a draft model's "draft")."""
        if source == "draft":
            self.draft_drafted += drafted
            self.draft_accepted += accepted
        else:
            self.context_drafted += drafted
            self.context_accepted += accepted


@dataclass
class LaneStep:
    tokens: list[RowTokens] = field(default_factory=list)
    snapshots: list[tuple[int, Snapshot]] = field(default_factory=list)  # (row, snapshot) taken in prefill
    prefill_rows: int = 0  # rows in this step's prefill chunk (0: none ran)
    prefill_tokens: int = 0  # prompt tokens the step's prefill ran (padding included)
    mixed: bool = False  # the prefill chunk's forward carried the decoding rows' step
    mtp: MTPCounts = field(default_factory=MTPCounts)  # the MTP lane's rounds this step


#: The engine's lanes by name ("kv": the all-attention lane of a model served through its library's
#: forward, the engine's one lane then).
LaneName = Literal["mtp", "plain", "kv"]


class Lane(Protocol):
    name: LaneName

    @property
    def has_work(self) -> bool: ...

    def __len__(self) -> int: ...

    @property
    def decode_tokens(self) -> int:
        """Tokens the lane's decoding rows run in one step (counted first against the budget)."""
        ...

    @property
    def prefilling(self) -> int:
        """Rows whose prefill would run this step (the lane's claim on the prefill budget)."""
        ...

    @property
    def finishing_costs(self) -> list[int]:
        """For each row whose prefill would run this step: the prefill share (tokens, padding
        included) with which this lane's next step finishes that row's prompt (the engine's
        finishing steps, `token_budget.finishing_shares`); none where the lane cannot say."""
        ...

    def add(self, spec: RowSpec) -> None: ...

    def step(self, prefill_budget: int | None = None) -> LaneStep: ...

    def extract(self, rid: int) -> Snapshot | None: ...

    def remove(self, rid: int) -> None: ...

    def clear(self) -> None: ...

    def close(self) -> None:
        """The engine is shutting down: release what the lane holds beyond its rows (threads)."""
        ...

    def cached_tokens(self, rid: int) -> int: ...

    def drafts(self, rid: int) -> dict[str, tuple[int, int]] | None:
        """Per draft source, (drafted, accepted) of a row so far; None in a lane that does not speculate."""
        ...

    def cache_layout(self) -> CacheLayout | None:
        """What a snapshot of this lane's rows holds (the disk tier's check: one token through fresh
        caches); None for a lane that takes no snapshots."""
        ...

    def warm(self, vocab_size: int, max_rows: int) -> str:
        """Run every shape the lane's steps can meet, up to `max_rows` rows, before traffic (no
        request meets a first-shape compile); what it ran, for the log ("" when nothing)."""
        ...


def sequence_end(token: int, emitted: int, max_tokens: int, eos: frozenset[int]) -> SequenceEnd | None:
    """Whether the `emitted`-th token of a row ends it: end-of-sequence, or its last allowed."""
    if token in eos:
        return "stop"
    return "length" if emitted >= max_tokens else None


def sparse_row(prompt: list[int], sparse: SparsePrefill, restored: int, snapshot_at: list[int]
               ) -> tuple[list[int], dict[str, Any], list[int]]:
    """SpecPrefill's row: only the kept tokens, each at its original position (the attention
    layers' RoPE sees the true positions, the recurrent layers the kept subsequence); decoding
    continues at the prompt's true end (`rope_delta` = positions skipped). Snapshots are taken
    only inside the dense head, where the kept state is the prompt's exact state.
    Returns (tokens to prefill, RowPrefill keyword arguments, snapshot lengths)."""
    ranges = sparse.ranges
    n = len(prompt)
    ok = bool(ranges) and ranges[-1][1] == n and all(
        0 <= a < b <= n and (i == 0 or ranges[i - 1][1] <= a) for i, (a, b) in enumerate(ranges))
    if not ok:
        raise ValueError("the SpecPrefill selection must be ascending ranges inside the prompt, ending at its end")
    dense = ranges[0][1] if ranges[0][0] == 0 else 0
    if restored > dense:
        raise ValueError("the SpecPrefill selection drops tokens the restored prefix covers")
    kept = [p for a, b in ranges for p in range(a, b)]
    positions = mx.broadcast_to(mx.array(kept, dtype=mx.int32)[None, None, :], (3, 1, len(kept)))
    kw: dict[str, Any] = {"positions": positions, "rope_delta": n - len(kept)}
    return [prompt[p] for p in kept], kw, [s for s in snapshot_at if s <= dense]

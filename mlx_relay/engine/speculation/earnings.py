"""What each draft source earns, per request and per round width (no MLX; the MTP lane's cohorts
ask it on the GPU thread before each round).

A row keeps, per source (`"mtp"`: the checkpoint's head; `"context"`: `context_drafts`), a
decayed count of drafts that were right and of proposals that ended in a miss, so its
acceptance follows what the request is writing now. Context proposals cost nothing to make, so
a round that does not verify them still scores them against what the row emitted (the *shadow*
count): a source that was switched off for a request keeps being measured and comes back when it
would pay. The head's proposal is only counted when it is verified.

`Earnings.expected(source, n)` is the tokens a proposal of `n` drafts adds under a geometric
model (each draft right with the row's acceptance, given the ones before it). A row's acceptance
starts from a prior: `PRIOR`, or what the source earned over the cohort's rows so far (`LaneTally`:
a head that missed on the rows before it is expected to miss on a new one, so a batch of short
requests does not verify every new row's head at a loss). A cohort times its
rounds per width (`RoundCosts`) and runs the width that yields the most expected tokens per
second over all its rows (`best_width`); a width is first run `FIRST_SAMPLES` times (only where it
promises `EXPLORE_GAIN` times the tokens of the best timed one: a wide round tried for one row's
proposal among 16 costs up to its width in steps on a device bound by its arithmetic), its time is
the median of its last rounds (a round beside a long prefill step does not decide), and every
`PROBE_EVERY` rounds one not chosen is timed again if it came within `PROBE_WITHIN` of the best.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Source = Literal["mtp", "context", "draft"]
SOURCES: tuple[Source, ...] = ("mtp", "context", "draft")

DECAY = 0.9  # each proposal's weight against the ones before it (about the last 10 count)
PRIOR = 0.5  # acceptance before a source was measured on the request
PRIOR_WEIGHT = 1.0  # ... worth this many proposals
PROBE_EVERY = 64  # rounds between re-timing a width the cohort is not running
COST_SAMPLES = 5  # a width's round time: the median of its last rounds (one slow round, e.g. beside a
FIRST_SAMPLES = 3  # prefill step, does not decide); a width is run this often before it is compared
EXPLORE_GAIN = 1.25  # an untimed width is tried where it promises this many times the best timed one's tokens
PROBE_WITHIN = 0.5  # a stale width is timed again where its tokens a second came within this of the best's


@dataclass
class SourceTally:
    """One source on one request: what it drafted and what was accepted, verified or shadowed."""

    drafted: int = 0  # verified drafts
    accepted: int = 0
    shadow_drafted: int = 0  # proposals scored against the emitted tokens without a verify
    shadow_accepted: int = 0
    hits: float = 0.0  # decayed: drafts right
    misses: float = 0.0  # decayed: proposals that ended in a wrong draft

    def record(self, proposed: int, accepted: int, *, verified: bool) -> None:
        if proposed <= 0:
            return
        accepted = min(accepted, proposed)
        if verified:
            self.drafted += proposed
            self.accepted += accepted
        else:
            self.shadow_drafted += proposed
            self.shadow_accepted += accepted
        self.hits = self.hits * DECAY + accepted
        self.misses = self.misses * DECAY + (1.0 if accepted < proposed else 0.0)

    @property
    def acceptance(self) -> float:
        """Probability that a draft is right, given the ones before it were."""
        return self.acceptance_from(PRIOR)

    def acceptance_from(self, prior: float) -> float:
        """... starting from `prior` (worth `PRIOR_WEIGHT` proposals)."""
        return (self.hits + prior * PRIOR_WEIGHT) / (self.hits + self.misses + PRIOR_WEIGHT)


LANE_DECAY = 0.95  # a cohort's tally: each round's weight against the ones before it


@dataclass
class LaneTally:
    """One source over a cohort's rows, decayed by round: the prior of a row's own tally."""

    drafted: int = 0  # verified drafts, every row's
    hits: float = 0.0
    misses: float = 0.0

    def record_round(self, verified: Sequence[tuple[int, int]]) -> None:
        """One round's (proposed, accepted) of each row that verified the source (a round that
        verified none does not count: a head the round plan switched off is measured again by its
        probes, `PROBE_EVERY`)."""
        self.hits *= LANE_DECAY
        self.misses *= LANE_DECAY
        for proposed, accepted in verified:
            if proposed > 0:
                self.drafted += proposed
                self.hits += min(accepted, proposed)
                self.misses += 1.0 if accepted < proposed else 0.0

    @property
    def prior(self) -> float:
        """A new row's prior for the source: `PRIOR` until the cohort verified any, then theirs."""
        if self.drafted == 0:
            return PRIOR
        return (self.hits + PRIOR * PRIOR_WEIGHT) / (self.hits + self.misses + PRIOR_WEIGHT)


@dataclass
class Earnings:
    tallies: dict[Source, SourceTally] = field(default_factory=lambda: {s: SourceTally() for s in SOURCES})

    def expected(self, source: Source, n: int, prior: float = PRIOR) -> float:
        """Tokens `n` drafts of `source` add to a round, expected (the row's acceptance from `prior`)."""
        a = self.tallies[source].acceptance_from(prior)
        return sum(a ** j for j in range(1, n + 1))

    def record(self, source: Source, proposed: int, accepted: int, *, verified: bool) -> None:
        self.tallies[source].record(proposed, accepted, verified=verified)


def agreed(proposal: Sequence[int], emitted: Sequence[int]) -> int:
    """Leading drafts of `proposal` equal to what the row emitted after the round's first token."""
    n = 0
    for d, t in zip(proposal, emitted, strict=False):
        if d != t:
            break
        n += 1
    return n


@dataclass
class RoundCosts:
    """Seconds per round at each width, for one cohort: the median of its last `COST_SAMPLES` rounds."""

    samples: dict[tuple[int, int], deque[float]] = field(default_factory=dict)  # (batch bucket, width) -> s
    rounds: int = 0
    last_run: dict[tuple[int, int], int] = field(default_factory=dict)

    def record(self, bucket: int, width: int, seconds: float) -> None:
        key = (bucket, width)
        self.samples.setdefault(key, deque(maxlen=COST_SAMPLES)).append(seconds)
        self.rounds += 1
        self.last_run[key] = self.rounds

    def seconds(self, bucket: int, width: int) -> float:
        return statistics.median(self.samples[(bucket, width)])

    def best_width(self, bucket: int, tokens: dict[int, float]) -> int:
        """The width (of `tokens`: width -> expected tokens of all rows at it) with the most
        tokens per second; the narrowest first while none is timed `FIRST_SAMPLES` times, then an
        untimed one narrower than the best, or wider and promising `EXPLORE_GAIN` times the best's
        tokens, then one stale by
        `PROBE_EVERY` rounds that came within `PROBE_WITHIN` of the best."""
        widths = sorted(tokens)
        timed = [w for w in widths if len(self.samples.get((bucket, w), ())) >= FIRST_SAMPLES]
        if not timed:
            return widths[0]

        def rate(w: int) -> float:
            return tokens[w] / self.seconds(bucket, w)

        best = max(timed, key=rate)
        for w in widths:
            # a narrower width costs less: tried whatever it promises; a wider one where it promises enough
            if w not in timed and (w < best or tokens[w] >= EXPLORE_GAIN * tokens[best]):
                return w
        for w in timed:
            stale = self.rounds - self.last_run.get((bucket, w), 0) >= PROBE_EVERY
            if w != best and tokens[w] > 0 and stale and rate(w) >= PROBE_WITHIN * rate(best):
                return w
        return best

"""The engine step's token budget (issue 30.6): a short request is never stuck behind long ones.

Counted in engine steps and tokens, never in time, on the float32 fixture: while a long prompt
prefills, a short request that arrives gets its first token within a few steps, then a token
every step; no step runs more prefill than the budget leaves after the decoding rows; the long
prompt goes on every step; and every output equals plain greedy decoding of its prompt (chunked
at any share, snapshot boundaries kept). In the plain lane, the MTP lane, and across the two
(long prompts in the MTP lane, the short one in the plain lane: the issue's case).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.scheduling.token_budget import (
    fair_shares,
    finishing_shares,
    prefill_budget,
    shortest_first,
    split_by_rows,
    step_budget,
)
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.messages.prefix_cache import PrefixPlan
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.reference import greedy_reference

BUDGET = 48
LONG = [list(range(3, 603)), list(range(700, 1000)) * 2]  # 600 tokens each
SHORT = [5, 6, 7, 8, 9]
SHORT_TOKENS = 6


def test_shortest_first_and_finishing_steps() -> None:
    assert shortest_first([5, 600, 600], 48) == [5, 22, 21]  # as max-min when one row fits
    assert shortest_first([30, 40, 600], 48) == [30, 9, 9]  # the shortest finishes (max-min: 16 each)
    assert shortest_first([40, 600], 40) == [40, 0]  # nothing left: the long row waits this step
    assert shortest_first([100, 9000], 256, 64) == [100, 128]
    # a prompt that can finish runs alone (each lane the share its finishing rows cost), the
    # cheapest first while they fit; an ordinary step when none can, or all can
    assert finishing_shares([[15, 1800], [18000]], 256, 3) == [15, 0]
    assert finishing_shares([[40], [100, 18000], [300]], 256, 4) == [40, 100, 0]
    assert finishing_shares([[15], []], 256, 3) == [15, 0]  # a lane that cannot finish its rows lists none
    assert finishing_shares([[18000], [9000]], 256, 2) is None
    assert finishing_shares([[15], [20]], 256, 2) is None
    assert finishing_shares([[15, 18000]], 0, 2) is None  # prefill held back


def test_shares_are_max_min_fair() -> None:
    assert fair_shares([5, 600, 600], 48) == [5, 22, 21]  # the short row whole, the rest split
    assert fair_shares([600], 48) == [48]
    assert fair_shares([10, 12], 48) == [10, 12]
    assert fair_shares([0, 100], 48) == [0, 48]
    assert fair_shares([100, 100, 100], 2) == [1, 1, 1]  # every row goes on
    assert sum(fair_shares([7, 30, 600, 9000], 256)) == 256
    # long rows' shares in whole chunks of the GatedDeltaNet prefill (64), short ones whole
    assert fair_shares([22, 9000, 9000], 256, 64) == [22, 64, 64]
    assert fair_shares([100, 9000], 256, 64) == [100, 128]
    assert fair_shares([9000, 9000], 100, 64) == [50, 50]
    assert prefill_budget(48, 2) == 46
    assert prefill_budget(48, 100) == 16  # prefill goes on however many rows decode
    assert prefill_budget(8, 100) == 8
    assert split_by_rows([2, 1, 0], 48) == [32, 16, 0]
    assert split_by_rows([0, 0], 48) == [0, 0]
    assert step_budget(None, 2048, "cuda", 32) == 2080  # a GPU: chunks as long as without a budget
    assert step_budget(None, 2048, "cpu", 32) == 256
    assert step_budget(100, 2048, "cpu", 32) == 100


@pytest.mark.parametrize(("long_mtp", "short_mtp"), [(False, False), (True, True), (True, False)],
                         ids=["plain", "mtp", "long-mtp-short-plain"])
def test_short_request_passes_long_prefills(gpu: Callable, fp32_model: Path, long_mtp: bool,
                                            short_mtp: bool) -> None:
    def run() -> tuple[Any, ...]:
        d = Driver(load_model(fp32_model), max_num_batched_tokens=BUDGET, prefill_step_size=64)
        longs = [d.add(Generate(f"long{i}", p, SamplingParams(max_tokens=4, mtp=long_mtp),
                                prefix=PrefixPlan(snapshot_at=[100 + 57 * i])))
                 for i, p in enumerate(LONG)]
        for _ in range(3):
            d.step()
        short = d.add(Generate("short", SHORT, SamplingParams(max_tokens=SHORT_TOKENS, mtp=short_mtp)))
        running = d.engine.scheduler.running
        long_lanes = {running[s].lane for s in longs}
        short_lane = None
        trace = []  # per step: (short's tokens so far, prefill tokens run, long rows' tokens so far)
        while short not in d.finished:
            before = d.engine.prefill_tokens
            d.step()
            short_lane = short_lane or (running[short].lane if short in running else None)
            trace.append((len(d.tokens[short]), d.engine.prefill_tokens - before,
                          sum(len(d.tokens[s]) for s in longs)))
            assert len(trace) < 100
        d.run()
        ref = greedy_reference(fp32_model, [*LONG, SHORT], max(4, SHORT_TOKENS))
        outs = [d.tokens[s] for s in (*longs, short)]
        snaps = [[s.length for s in d.snapshots[i] if s.kind == "system"] for i in longs]
        finishing = d.engine.shares.finishing_steps
        d.engine.close()
        return trace, outs, ref, snaps, (long_lanes, short_lane), finishing

    trace, outs, ref, snaps, lanes, finishing = gpu(run)
    # the short prompt's step was a finishing step: its tokens alone (in the plain lane's one
    # forward, each row of the chunk as many: the long rows beside it 5 tokens each), not the budget
    assert finishing >= 1 and trace[0][1] <= 3 * len(SHORT), trace
    assert lanes == ({"mtp" if long_mtp else "plain"}, "mtp" if short_mtp else "plain")
    first = next(i for i, (n, _, _) in enumerate(trace) if n > 0)
    # its prefill in the next step, and its first token out of that step (the MTP lane and now the
    # plain lane too: its decode batch feeds that token on the following step, and emits what
    # follows it one step later, as it emits every token: so the plain lane has one step without a
    # token after the first, each token out no later than before)
    assert first == 0, trace
    second = first + (2 if lanes[1] == "plain" else 1)
    assert trace[second - 1][0] == 1 and trace[second][0] == 2, trace
    # from its second token to its last, a token every step, while the long prompts still prefill
    counts = [n for n, _, _ in trace[second:]]
    assert all(b > a for a, b in pairwise(counts)), trace
    assert all(longs == 0 for _, _, longs in trace), trace
    # no step ran more prefill than the budget, and the long prompts went on in every step
    assert all(0 < tokens <= BUDGET for _, tokens, _ in trace), trace
    assert outs == [ref[0][:4], ref[1][:4], ref[2][:SHORT_TOKENS]]
    assert snaps == [[100], [157]]

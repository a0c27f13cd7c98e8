"""Drafts copied from the context (issue 33): the index, the earnings, and the MTP lane verifying
them, on the real float32 fixtures.

Exactness: with context drafts on, greedy output equals plain decoding by the raw mlx-vlm loop,
compiled and eager rounds, both verifiers, alone and in ragged batches, for rows whose drafts are
mostly right (the `bigram` fixture copies what followed a token before) and mostly wrong (`fp32`).
Sampling: a copied draft is a point mass, and the speculative-sampling walk keeps the target's
distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.speculation.context_drafts import ContextDrafts
from mlx_relay.engine.speculation.earnings import (
    EXPLORE_GAIN,
    FIRST_SAMPLES,
    PROBE_EVERY,
    Earnings,
    RoundCosts,
    agreed,
)
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.reference import greedy_reference
from tests.conftest import References
from tests.test_mtp import _exact_two_token_distribution, assert_two_tokens_fit, run_engine

BASE = list(range(5, 25))


def test_context_drafts_follow_the_longest_most_recent_match() -> None:
    ctx = ContextDrafts([1, 2, 3, 4, 9, 2, 3, 7, 8, 3], max_ngram=3)
    assert ctx.propose(2) == [7, 8]  # "3" last followed by 7, 8 (most recent occurrence)
    ctx.extend([4])  # "3 4" occurred once: followed by 9
    assert ctx.propose(3) == [9, 2, 3]
    ctx.extend([9, 2, 3])  # "9 2 3" -> 7 beats "3" -> 4 (both exist; the longer wins)
    assert ctx.propose(1) == [7]
    assert ContextDrafts([5, 6, 7]).propose(4) == []  # nothing repeats
    assert ContextDrafts([]).propose(4) == [] and ctx.propose(0) == []


def test_a_long_context_is_indexed_a_bounded_stretch_per_proposal() -> None:
    """No proposal indexes more than `index_per_call` positions; once caught up, the proposals are
    those of the whole index."""
    tokens = [i % 97 for i in range(5000)] + [5, 6, 7]
    ctx = ContextDrafts(tokens, index_per_call=1000)
    for _ in range(5):
        before = ctx.indexed
        ctx.propose(3)
        assert ctx.indexed - before <= 1000
    whole = ContextDrafts(tokens, index_per_call=10_000)
    assert ctx.propose(3) == whole.propose(3) == [8, 9, 10]


def test_earnings_follow_what_the_request_writes() -> None:
    e = Earnings()
    before = e.expected("context", 4)
    for _ in range(10):
        e.record("context", 4, 0, verified=False)  # shadowed misses
    assert e.expected("context", 4) < 0.1 < before
    for _ in range(10):
        e.record("context", 4, 4, verified=True)
    assert e.expected("context", 4) > 2.5
    t = e.tallies["context"]
    assert (t.drafted, t.accepted, t.shadow_drafted, t.shadow_accepted) == (40, 40, 40, 0)
    assert agreed([1, 2, 3], [1, 2, 9, 9]) == 2 and agreed([1], []) == 0


def test_round_costs_pick_tokens_per_second_and_probe() -> None:
    costs = RoundCosts()
    for _ in range(FIRST_SAMPLES):
        assert costs.best_width(1, {2: 1.5, 5: 3.0}) == 2  # untimed: tried first, FIRST_SAMPLES times
        costs.record(1, 2, 1.0)
    for seconds in (9.0, 1.5, 1.5):  # one slow round (beside a prefill step) does not decide
        assert costs.best_width(1, {2: 1.5, 5: 3.0}) == 5
        costs.record(1, 5, seconds)
    assert costs.best_width(1, {2: 1.5, 5: 3.0}) == 5  # 2.0 tokens/s against 1.5
    assert costs.best_width(1, {2: 1.5, 5: 1.6}) == 2
    for _ in range(PROBE_EVERY):
        costs.record(1, 2, 1.0)
    assert costs.best_width(1, {2: 1.5, 5: 1.6}) == 5  # stale: timed again (1.07 tokens/s, within half of 1.5)
    for _ in range(PROBE_EVERY):
        costs.record(1, 2, 1.0)
    assert costs.best_width(1, {2: 1.5, 5: 0.5}) == 2  # stale but far behind (0.33 a second): not timed


def test_a_wide_round_is_tried_only_where_it_promises_enough() -> None:
    """An untimed width is tried only where its expected tokens are EXPLORE_GAIN times the best timed
    one's: one row's context proposal among 16 rows (17 tokens against 16) does not buy a wide round,
    which on a device bound by its arithmetic costs up to its width in steps (on this CPU at 16 rows,
    4% of rounds wide cost 0.64x plain decoding: speculation-miss-cpu-2026-11-28)."""
    costs = RoundCosts()
    for _ in range(FIRST_SAMPLES):
        assert costs.best_width(16, {1: 16.0, 9: 17.0}) == 1
        costs.record(16, 1, 1.0)
    assert costs.best_width(16, {1: 16.0, 9: 17.0}) == 1  # 1.06x: not tried
    assert costs.best_width(16, {1: 16.0, 9: 16.0 * EXPLORE_GAIN}) == 9  # tried
    # a narrower width is tried whatever it promises (it costs less): a head verified from the start
    # is weighed against one token a row
    head = RoundCosts()
    for _ in range(FIRST_SAMPLES):
        head.record(1, 2, 1.2)
    assert head.best_width(1, {1: 1.0, 2: 1.01}) == 1


def test_a_round_whose_time_held_other_work_is_not_recorded() -> None:
    """A pipelined one-token round's time is the interval between two reads; where a joining row's
    prefill ran in it the plan is marked untimed and its seconds are not a round's cost (recorded,
    they made one-token rounds look 6x their cost and kept 16 rows on wide rounds of context drafts
    at 0.59x plain: benchmarks/results/speculation-batch-cpu-2026-11-28/)."""
    from mlx_relay.engine.lane import MTPCounts
    from mlx_relay.engine.lanes.mtp_rows import MTPRow
    from mlx_relay.engine.lanes.round_drafts import RoundDrafts, RoundPlan

    drafts = RoundDrafts(block_size=2, max_context=0, min_width=1)
    row = MTPRow(rid=0, prompt=[1, 2], max_tokens=100)
    drafts.settle([row], RoundPlan(1, [[]], [False], heads=[False], timed=False), {0: [7]}, [0], MTPCounts())
    assert drafts.costs.samples == {}
    drafts.settle([row], RoundPlan(1, [[]], [False], heads=[False]), {0: [8]}, [0], MTPCounts())
    assert list(drafts.costs.samples) == [(1, 1)]


def test_a_head_is_switched_off_where_its_rounds_cost_more_than_they_earn_and_probed() -> None:
    """The round's plan weighs the head's block against one token a row (the head off) at their
    measured round times once the head has been verified enough: a head whose drafts miss is off
    (its block not even timed: it promises under EXPLORE_GAIN times one token's), and so is one whose
    drafts land where its rounds cost more than they earn (a batch bound by its arithmetic: a block-2
    round at 2.5 steps), verified again once every PROBE_EVERY rounds (so it can come back). A head
    whose drafts land at a round of 1.5 steps stays on, the head-off width timed once a PROBE_EVERY
    rounds."""
    from mlx_relay.engine.lanes.mtp_rows import MTPRow
    from mlx_relay.engine.lanes.round_drafts import RoundDrafts

    def plans(accepted: int, block_cost: float) -> list[int]:
        drafts = RoundDrafts(block_size=2, max_context=0, min_width=1)
        row = MTPRow(rid=0, prompt=[1, 2], max_tokens=10_000)
        for _ in range(20):
            row.earnings.record("mtp", 1, accepted, verified=True)
            drafts.head_tally.record_round([(1, accepted)])
        widths = []
        for _ in range(2 * PROBE_EVERY):
            plan = drafts.plan([row])
            assert plan.heads == [plan.width == 2]  # one token a row: no row takes the head
            widths.append(plan.width)
            drafts.costs.record(1, plan.width, {1: 1.0, 2: block_cost}[plan.width])
        return widths

    # a head that missed every draft promises nothing over one token a row: its block is never timed
    assert plans(0, 1.5) == [1] * (2 * PROBE_EVERY)
    rest = 2 * PROBE_EVERY - 2 * FIRST_SAMPLES
    for widths, on in ((plans(1, 2.5), False), (plans(1, 1.5), True)):
        assert widths[:2 * FIRST_SAMPLES] == [1] * FIRST_SAMPLES + [2] * FIRST_SAMPLES  # each width timed first
        # then the one that pays, the other timed again once a PROBE_EVERY rounds
        kept, probed = (2, 1) if on else (1, 2)
        assert 1 <= widths[2 * FIRST_SAMPLES:].count(probed) <= 2 and widths[2 * FIRST_SAMPLES:].count(kept) >= rest - 2


def test_a_new_row_takes_the_cohort_s_measure_of_the_head() -> None:
    """A row's head is expected to earn what it earned on the cohort's rows before it (its own tally
    starts from theirs), and the head is weighed once the cohort verified HEAD_OFF_AFTER drafts,
    however new its rows: 16 short requests whose head misses do not each verify it 16 drafts at a
    loss (0.47x plain on an H200 at c=16 with the weighing per row: gpu-h200-2026-11-28d)."""
    from mlx_relay.engine.lane import MTPCounts
    from mlx_relay.engine.lanes.mtp_rows import MTPRow
    from mlx_relay.engine.lanes.round_drafts import HEAD_OFF_AFTER, RoundDrafts
    from mlx_relay.engine.speculation.earnings import PRIOR

    drafts = RoundDrafts(block_size=2, max_context=0, min_width=1)
    rows = [MTPRow(rid=i, prompt=[1, 2], max_tokens=10_000) for i in range(16)]
    assert drafts.head_tally.prior == PRIOR
    plan = drafts.plan(rows)
    assert plan.width == 2 and all(plan.heads)  # nothing measured: the head's block, every row
    drafts.settle(rows, plan, {r.rid: [5] for r in rows}, [0] * 16, MTPCounts())  # every draft missed
    assert drafts.head_tally.drafted == 16 >= HEAD_OFF_AFTER and drafts.head_tally.prior < 0.5
    newcomer = MTPRow(rid=99, prompt=[1, 2], max_tokens=10_000)
    assert newcomer.earnings.expected("mtp", 1, drafts.head_tally.prior) < 0.34
    # weighed from the next round: the one-token width is timed (then the cheaper one runs)
    assert drafts.plan([*rows[1:], newcomer]).width == 1
    # a head that lands on a cohort's rows lends a newcomer that expectation
    landing = RoundDrafts(block_size=2, max_context=0, min_width=1)
    for _ in range(8):
        landing.head_tally.record_round([(1, 1)] * 4)
    assert newcomer.earnings.expected("mtp", 1, landing.head_tally.prior) > 0.8


def _copy_prompt(path: Any, tokens: int) -> list[int]:
    """A prompt that holds the model's own greedy continuation of BASE, then BASE again: what the
    model writes next was written before (an agent re-emitting a file)."""
    first = greedy_reference(path, [BASE], tokens)[0]
    return BASE + first + BASE


@pytest.mark.parametrize(("variant", "compiled", "verify", "method", "head"), [
    ("bigram", True, "batched", "context", True), ("bigram", False, "batched", "context", True),
    ("bigram", False, "exact", "auto", True), ("bigram", True, "batched", "auto", True),
    ("fp32", True, "batched", "context", True), ("fp32", False, "batched", "auto", True),
    # no head (MTP off: the lane verifies context drafts only, as for a checkpoint without one)
    ("bigram", True, "batched", "context", False), ("bigram", False, "batched", "context", False),
    ("bigram", True, "batched", "auto", False), ("fp32", True, "batched", "auto", False),
])
def test_context_drafts_keep_greedy_output(gpu: Callable, references: References, variant: str, compiled: bool,
                                           verify: str, method: str, head: bool) -> None:
    path = fixture_path(FixtureSpec(variant=variant, seed=0))
    max_tokens = [40, 12, 33, 25]

    def run() -> tuple[Any, ...]:
        copy = _copy_prompt(path, 30)
        prompts = [copy, BASE, copy[5:], BASE * 2]
        loaded = load_model(path)
        plan = [(at, Generate(f"r{i}", p, SamplingParams(max_tokens=m)))
                for i, (at, p, m) in enumerate(zip((0, 0, 2, 4), prompts, max_tokens, strict=True))]
        # "always": every proposal verified (the counts below do not depend on timed choices); the
        # auto cases time their widths, and the tokens must be the same either way
        policy = "auto" if method == "auto" else "always"
        got = run_engine(loaded, plan, mtp_max_batch=4, compile_mtp=compiled, mtp_verify=verify,
                         speculation=method, max_draft_tokens=4, mtp_policy="always", mtp=head,
                         context_policy=policy)
        return got, references(path, prompts, max(max_tokens))

    (tokens, finished, stats), ref = gpu(run)
    for sid, want in enumerate(ref):
        assert tokens[sid] == want[:max_tokens[sid]], sid
    drafted = sum(f.drafts.context.drafted for f in finished.values())
    accepted = sum(f.drafts.context.accepted for f in finished.values())
    assert 0 <= accepted <= drafted
    if variant == "bigram" and method == "context":
        # the copy rows verify copied drafts and most are right: fewer rounds than tokens
        assert finished[0].drafts.context.accepted >= 20, finished[0]
        assert stats.mtp_rounds < sum(max_tokens)
    if method == "context" or not head:
        assert all(f.drafts.mtp.drafted == 0 for f in finished.values())  # the head's drafts are not used
    if not head and method == "context":  # every row ran in the lane, one token per round where nothing was copied
        assert stats.mtp_running == 0 and stats.mtp_rounds > 0
    if not head and method == "auto":  # auto: context drafts ride with the head's; without it, plainly
        assert stats.mtp_rounds == 0 and drafted == 0


def test_context_drafts_keep_the_sampling_distribution(gpu: Callable) -> None:
    """Sampling rows whose second token is decided by a copied draft's walk (a point mass q:
    accept with p(d), else draw from p without d): the joint distribution of the first two tokens
    over many seeds fits the exact one (G-test at p = 0.001). Without a head, so that the rows
    with no proposal walk with q = 0 (a draw from p); the walk itself is the head's
    (tests/test_mtp.py pins it with the head's q)."""
    head = False
    path = fixture_path(FixtureSpec(variant="bigram", seed=0))
    n = 200
    temperature = 1.5

    def run() -> tuple[Any, ...]:
        prompt = _copy_prompt(path, 30)
        loaded = load_model(path)
        # no seed: a seeded row verifies the head's drafts only (its draws must not depend on the
        # lane's widths); the engine seeds each row from its own seed instead
        plan = [(i // 16, Generate(f"s{i}", prompt, SamplingParams(temperature=temperature, top_k=4, max_tokens=2)))
                for i in range(n)]
        tokens, finished, _stats = run_engine(loaded, plan, max_num_seqs=16, mtp_max_batch=16,
                                              speculation="context", max_draft_tokens=2, mtp=head,
                                              context_policy="always")
        params = SamplingParams(temperature=temperature, top_k=4, max_tokens=2)
        return tokens, finished, _exact_two_token_distribution(path, prompt, params)

    tokens, finished, exact = gpu(run)
    drafted = sum(f.drafts.context.drafted for f in finished.values())
    accepted = sum(f.drafts.context.accepted for f in finished.values())
    assert drafted > n // 2 and 0 < accepted < drafted  # both branches of the walk ran
    assert_two_tokens_fit(tokens, exact, n)


def test_pipelined_one_token_rounds_end_at_a_stop_string_with_an_exact_turn_snapshot(gpu: Callable) -> None:
    """Rows whose drafts miss run one-token rounds launched before the last is read. A row that ends
    at a stop string has had one more token fed by the round in flight; its turn snapshot still
    holds exactly prompt + reply (all but the last token), and the next turn restored from it
    decodes as plain greedy decoding of the whole conversation."""
    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    prompt = list(range(5, 45))

    def run() -> tuple[Any, ...]:
        from mlx_relay.messages.prefix_cache import PrefixPlan
        from mlx_relay.testing.engine_driver import Driver

        loaded = load_model(path)
        tok = loaded.processor.tokenizer
        ref = greedy_reference(path, [prompt], 30)[0]
        stop = tok.decode(ref[:20])[-3:]  # text that first ends inside the reply's 20th token or before
        d = Driver(loaded, mtp=False, speculation="context", max_draft_tokens=4, mtp_max_batch=4)
        a = d.add(Generate("a", prompt, SamplingParams(max_tokens=30, stop=(stop,)),
                           prefix=PrefixPlan(snapshot_turn=True)))
        d.run()
        (turn,) = [s for s in d.snapshots[a] if s.kind == "turn"]
        turn2 = prompt + turn.generated + [400, 401, 402]
        e = d.add(Generate("e", turn2, SamplingParams(max_tokens=12), prefix=PrefixPlan(turn.handle, turn.length)))
        d.run()
        want = greedy_reference(path, [turn2], 12)[0]
        stats = d.engine.stats()
        d.engine.close()
        return d.tokens[a], d.finished[a], turn, d.tokens[e], d.finished[e], want, ref, stats

    tokens, done, turn, tokens2, done2, want, ref, stats = gpu(run)
    assert done.reason == "stop" and tokens == ref[:len(tokens)] and len(tokens) < 30
    assert turn.length == 40 + len(tokens) - 1 and turn.generated == tokens[:-1]
    assert done2.cached_tokens == turn.length and tokens2 == want
    assert stats.mtp_rounds > 0 and stats.mtp_running == 0
    # the rows' drafts missed: their rounds were one token, pipelined (the engine's count says so)
    assert 0 < stats.pipelined_rounds <= stats.mtp_rounds


def test_a_row_joining_while_a_one_token_round_is_in_flight_never_gives_another_a_token_past_its_end(
        gpu: Callable) -> None:
    """A row that joins the compiled cohort reads the one-token round in flight first (a drain). If
    that round gave another row its last allowed token, the next round must not run for it: its
    tokens go out alone and the lane ends it. (A row once got max_tokens + 1 tokens: the in-process
    relay test saw it about one run in six.) The newcomer joins at every step of the other's reply
    here; both replies equal greedy decoding, at exactly their lengths."""
    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    first, second = list(range(5, 45)), list(range(50, 70))

    def run() -> tuple[list[list[int]], list[int], list[int]]:
        from mlx_relay.testing.engine_driver import Driver

        loaded = load_model(path)
        ref_a, ref_b = greedy_reference(path, [first, second], 8)
        got: list[list[int]] = []
        for join_at in range(12):
            d = Driver(loaded, mtp=False, speculation="context", max_draft_tokens=4, mtp_max_batch=4,
                       prefill_step_size=64)
            a = d.add(Generate("a", first, SamplingParams(max_tokens=8)))
            for _ in range(join_at):
                if d.engine.has_work:
                    d.step()
            b = d.add(Generate("b", second, SamplingParams(max_tokens=8)))
            d.run()
            d.engine.close()
            got += [d.tokens[a], d.tokens[b]]
        return got, ref_a, ref_b

    got, ref_a, ref_b = gpu(run)
    assert got[0::2] == [ref_a] * 12 and got[1::2] == [ref_b] * 12


def test_the_compiled_round_s_block_follows_the_rows_acceptance() -> None:
    """With blocks 2 .. 4 (the compiled cohort at --mtp-block-size 4), once the head is weighed the
    round runs the block whose expected tokens a second are the most at the blocks' measured times:
    a head right 0.95 of the time runs the longest block, one right 0.3 of the time the shortest
    (issue 45.3: the block follows the measured acceptance)."""
    from mlx_relay.engine.lanes.mtp_rows import MTPRow
    from mlx_relay.engine.lanes.round_drafts import HEAD_OFF_AFTER, RoundDrafts

    def steady_block(acceptance: float) -> int:
        drafts = RoundDrafts(block_size=4, max_context=0, min_width=1, min_block=2)
        row = MTPRow(rid=0, prompt=[1, 2], max_tokens=10_000)
        # the row's own history and the cohort's: a draft right at `acceptance`, the misses spread evenly
        history = [int((i + 1) * acceptance) - int(i * acceptance) for i in range(100)]
        for ok in history:
            row.earnings.record("mtp", 1, ok, verified=True)
        drafts.head_tally.record_round([(1, ok) for ok in history])
        assert drafts.head_tally.drafted >= HEAD_OFF_AFTER
        seconds = {1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6}  # a round's time grows with its block
        widths = []
        for _ in range(40):
            width = drafts.plan([row]).width
            widths.append(width)
            drafts.costs.record(1, width, seconds[width])
        return max(set(widths[-10:]), key=widths[-10:].count)

    assert steady_block(0.95) == 4
    assert steady_block(0.3) in (1, 2)
    assert RoundDrafts(block_size=4, max_context=0, min_width=2).blocks == range(4, 5)  # the eager round: one


@pytest.mark.parametrize("variant", ["bigram", "fp32"])
def test_rounds_of_several_blocks_keep_greedy_output(gpu: Callable, variant: str) -> None:
    """--mtp-block-size 4, compiled: rounds of blocks 2 to 4 as the measured acceptance says, the
    output plain greedy decoding's (the head's drafts from its own drafts at each block)."""
    path = fixture_path(FixtureSpec(variant=variant, seed=0))
    max_tokens = [48, 30]
    prompts = [BASE, list(range(30, 60))]

    def run() -> tuple[Any, ...]:
        loaded = load_model(path)
        plan = [(0, Generate(f"r{i}", p, SamplingParams(max_tokens=m)))
                for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
        got = run_engine(loaded, plan, mtp_max_batch=4, compile_mtp=True, mtp_verify="batched",
                         mtp_block_size=4, speculation="mtp", mtp_policy="always", context_policy="auto")
        return got, greedy_reference(path, prompts, max(max_tokens))

    (tokens, _finished, _stats), ref = gpu(run)
    for sid, want in enumerate(ref):
        assert tokens[sid] == want[:max_tokens[sid]], sid

"""SpecPrefill's anchors (issue 19.4): chunks holding a run of tokens that the query repeats are
kept ahead of the draft's scores, within the keep budget. Pure functions, no model: the anchors
against a brute-force reference, the selection's budget, and anchors off = the scores' selection
exactly (the selection as it was before anchors, written out below)."""

from __future__ import annotations

import math
import random
from collections import Counter

import msgspec
import pytest

from mlx_relay.actors.specprefill_scorer import SpecPrefillScorer
from mlx_relay.config import SpecPrefillConfig
from mlx_relay.messages.specprefill import AnchorRule, PlanSpecPrefill, SparsePrefill
from mlx_relay.specprefill.anchors import anchor_chunks
from mlx_relay.specprefill.selection import select_chunks


def scores_only(scores: list[float], start: int, chunk_size: int, keep_fraction: float) -> SparsePrefill:
    """The selection before anchors existed (mlx_relay/specprefill/selection.py at 53a5f36)."""
    n = len(scores)
    total = start + n
    chunks = math.ceil(n / chunk_size)
    if chunks <= 2 or keep_fraction >= 1.0:
        return SparsePrefill([(0, total)] if total else [])
    want = max(2, math.ceil(keep_fraction * chunks))
    means = [math.fsum(scores[i * chunk_size:(i + 1) * chunk_size]) / len(scores[i * chunk_size:(i + 1) * chunk_size])
             for i in range(chunks)]
    middle = sorted(range(1, chunks - 1), key=lambda i: (-means[i], i))
    kept = sorted({0, chunks - 1, *middle[:want - 2]})
    ranges: list[tuple[int, int]] = [(0, start)] if start else []
    for i in kept:
        a, b = start + i * chunk_size, min(total, start + (i + 1) * chunk_size)
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return SparsePrefill(ranges)


def brute_anchors(tokens: list[int], start: int, chunk_size: int, rule: AnchorRule) -> frozenset[int]:
    """The anchor rule written out plainly: O(prompt x query), tuples, no hashing."""
    n, total = rule.ngram, len(tokens)
    query = max(0, total - rule.query_tokens)
    grams = {tuple(tokens[i:i + n]) for i in range(query, total - n + 1)}
    before = Counter(tuple(tokens[i:i + n]) for i in range(0, query - n + 1))
    out: set[int] = set()
    for i in range(0, query - n + 1):
        gram = tuple(tokens[i:i + n])
        if gram not in grams or before[gram] > rule.max_occurrences:
            continue
        for p in range(i, min(i + n + rule.follow, total)):
            if p >= start and p < query - (query - start) % chunk_size:  # not in a chunk holding the query
                out.add((p - start) // chunk_size)
    return frozenset(out)


def chunks_of(sparse: SparsePrefill, start: int, chunk_size: int) -> set[int]:
    return {(p - start) // chunk_size for a, b in sparse.ranges for p in range(max(a, start), b)}


def random_prompt(n: int, seed: int, vocab: int = 50_000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 5 + vocab) for _ in range(n)]


# -- which chunks are anchors ---------------------------------------------------------------------


def test_the_chunk_holding_what_the_query_names_is_an_anchor() -> None:
    tokens = random_prompt(1000, 1)
    name = [901, 902, 903, 904]  # "ABC-12", say
    tokens[410:414] = name
    tokens[980:984] = name  # the question repeats it
    rule = AnchorRule(ngram=4, query_tokens=64, max_occurrences=4)
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=rule) == {4}
    # a shorter n-gram of the same name too; the prompt's random rest repeats nothing
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=msgspec.structs.replace(rule, ngram=2)) == {4}


def test_an_occurrence_across_a_boundary_anchors_both_chunks() -> None:
    tokens = random_prompt(1000, 2)
    tokens[398:402] = [901, 902, 903, 904]
    tokens[980:984] = [901, 902, 903, 904]
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=AnchorRule(4, 64, 4)) == {3, 4}


def test_follow_anchors_what_comes_after_the_name() -> None:
    tokens = random_prompt(1000, 3)
    tokens[390:394] = [901, 902, 903, 904]  # a key; its value follows, from 394 on
    tokens[980:984] = [901, 902, 903, 904]
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=AnchorRule(4, 64, 4, follow=6)) == {3}
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=AnchorRule(4, 64, 4, follow=7)) == {3, 4}


def test_common_ngrams_are_boilerplate_and_anchor_nothing() -> None:
    tokens = random_prompt(2000, 4)
    marker = [7, 8, 9]  # a turn marker: before every message
    for at in (100, 500, 900, 1300):
        tokens[at:at + 3] = marker
    tokens[1990:1993] = marker
    rule = AnchorRule(3, 64, max_occurrences=4)
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=rule) == {1, 5, 9, 13}  # four: still rare enough
    tokens[1700:1703] = marker  # a fifth time before the query: boilerplate
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=rule) == frozenset()


def test_the_query_chunks_and_the_restored_prefix_are_never_anchors() -> None:
    tokens = random_prompt(1000, 5)
    name = [901, 902, 903]
    for at in (50, 330, 925, 985):  # 925: before the query (the last 64 tokens) but in its chunk
        tokens[at:at + 3] = name
    rule = AnchorRule(3, 64, 4)
    assert anchor_chunks(tokens, start=0, chunk_size=100, rule=rule) == {0, 3}
    # scored from 200 on: the occurrence at 50 is in the restored prefix (but still counts as one)
    assert anchor_chunks(tokens, start=200, chunk_size=100, rule=rule) == {1}
    assert anchor_chunks(tokens, start=200, chunk_size=100, rule=msgspec.structs.replace(rule, max_occurrences=2)) \
        == frozenset()
    # a prompt that is all query has nothing to anchor
    assert anchor_chunks(tokens[-60:], start=0, chunk_size=10, rule=rule) == frozenset()


def test_anchors_equal_the_plain_definition() -> None:
    """Against the brute-force rule, on prompts of small vocabularies (n-grams repeat a lot, some
    just often enough to be boilerplate), at random starts, chunk sizes and rules."""
    found = 0
    for seed in range(60):
        rng = random.Random(seed)
        tokens = random_prompt(rng.randrange(50, 700), seed, vocab=rng.choice((4, 12, 40, 400)))
        start = rng.randrange(0, len(tokens) // 2)
        chunk = rng.choice((1, 7, 16, 64))
        rule = AnchorRule(ngram=rng.randrange(1, 5), query_tokens=rng.choice((8, 32, 64)),
                          max_occurrences=rng.choice((1, 3, 8, 30)), follow=rng.choice((0, 3, 16)))
        got = anchor_chunks(tokens, start=start, chunk_size=chunk, rule=rule)
        assert got == brute_anchors(tokens, start, chunk, rule), f"seed {seed}"
        found += bool(got)
    assert 20 <= found <= 50  # both kinds of case were met


# -- the selection ---------------------------------------------------------------------------------


def test_a_low_scored_anchor_is_kept_in_place_of_the_lowest_scored_pick() -> None:
    scores = [1.0] * 1000
    for i in range(400, 500):
        scores[i] = 0.0  # the draft thinks chunk 4 does not matter
    for i in range(700, 800):
        scores[i] = 0.5  # nor chunk 7 much
    plain = select_chunks(scores, start=0, chunk_size=100, keep_fraction=0.6)  # 6 of 10 chunks
    assert chunks_of(plain.sparse, 0, 100) == {0, 1, 2, 3, 5, 9}
    assert (plain.anchored, plain.rescued, plain.dropped) == (0, 0, 0)
    got = select_chunks(scores, start=0, chunk_size=100, keep_fraction=0.6, anchors={4})
    assert chunks_of(got.sparse, 0, 100) == {0, 1, 2, 3, 4, 9}  # 5 (the last by score, a tie on 1.0) gave way
    assert got.sparse.kept == plain.sparse.kept
    assert (got.anchored, got.rescued, got.dropped) == (1, 1, 0)
    # an anchor the scores keep anyway changes nothing; the first and last chunk are no anchors
    same = select_chunks(scores, start=0, chunk_size=100, keep_fraction=0.6, anchors={0, 2, 9})
    assert same.sparse == plain.sparse and (same.anchored, same.rescued, same.dropped) == (1, 0, 0)


def test_more_anchors_than_the_budget_keeps_the_highest_scored() -> None:
    rng = random.Random(7)
    scores = [rng.random() for _ in range(2000)]
    chunk, keep = 50, 0.2  # 40 chunks: 8 kept, the first, the last and 6 more
    means = {i: sum(scores[i * chunk:(i + 1) * chunk]) / chunk for i in range(40)}
    anchors = set(range(1, 39, 3))  # 13 anchors
    got = select_chunks(scores, start=0, chunk_size=chunk, keep_fraction=keep, anchors=anchors)
    kept = chunks_of(got.sparse, 0, chunk)
    assert len(kept) == 8 and got.sparse.kept == 8 * chunk
    best = sorted(anchors, key=lambda i: -means[i])[:6]
    assert kept == {0, 39, *best}
    assert (got.anchored, got.dropped) == (6, 13 - 6)
    assert got.rescued == len(set(best) - chunks_of(select_chunks(scores, start=0, chunk_size=chunk,
                                                                  keep_fraction=keep).sparse, 0, chunk))


def test_anchors_take_at_most_their_share_of_the_budget() -> None:
    scores = [float(i % 7) for i in range(4000)]
    chunk = 40  # 100 chunks, keep 0.2: 20 kept, 18 beyond the first and the last
    anchors = set(range(2, 98, 2))  # 48 anchors
    for share, room in ((1.0, 18), (0.5, 9), (0.25, 5), (0.01, 1)):
        got = select_chunks(scores, start=0, chunk_size=chunk, keep_fraction=0.2, anchors=anchors, anchor_share=share)
        assert len(chunks_of(got.sparse, 0, chunk)) == 20
        assert (got.anchored, got.dropped) == (room, 48 - room)
    with pytest.raises(ValueError):
        select_chunks(scores, start=0, chunk_size=chunk, keep_fraction=0.2, anchors=anchors, anchor_share=0.0)


@pytest.mark.parametrize("seed", range(8))
def test_without_anchors_the_selection_is_the_scores_alone(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 5000)
    scores = [float(rng.randrange(4)) for _ in range(n)]  # ties everywhere
    start, chunk, keep = rng.randrange(0, 300), rng.choice((1, 16, 64)), rng.choice((0.05, 0.3, 0.5, 1.0))
    want = scores_only(scores, start, chunk, keep)
    assert select_chunks(scores, start=start, chunk_size=chunk, keep_fraction=keep).sparse == want
    assert select_chunks(scores, start=start, chunk_size=chunk, keep_fraction=keep, anchors=()) == \
        select_chunks(scores, start=start, chunk_size=chunk, keep_fraction=keep)
    # a rule that finds nothing (a random prompt repeats no 4-gram) selects the same
    tokens = random_prompt(start + n, seed)
    found = anchor_chunks(tokens, start=start, chunk_size=chunk, rule=AnchorRule(4, 64, 4, 16))
    assert found == frozenset()
    assert select_chunks(scores, start=start, chunk_size=chunk, keep_fraction=keep, anchors=found).sparse == want


# -- the scorer's plan -----------------------------------------------------------------------------


def test_the_plan_carries_the_servers_rule_or_the_requests() -> None:
    config = SpecPrefillConfig(draft_model="d", threshold=100, chunk_size=16)
    scorer = SpecPrefillScorer(config)
    plan = scorer.decide(PlanSpecPrefill("a", 1000)).score
    assert plan is not None and plan.anchor == AnchorRule(2, 64, 4, 16, 0.5)
    assert scorer.decide(PlanSpecPrefill("b", 1000, anchor_ngram=0)).score.anchor is None  # type: ignore[union-attr]
    long = scorer.decide(PlanSpecPrefill("c", 1000, anchor_ngram=80)).score
    assert long is not None and long.anchor == AnchorRule(80, 80, 4, 16, 0.5)  # the query holds one n-gram at least
    off = SpecPrefillScorer(msgspec.structs.replace(config, anchor_ngram=0))
    assert off.decide(PlanSpecPrefill("d", 1000)).score.anchor is None  # type: ignore[union-attr]
    asked = off.decide(PlanSpecPrefill("e", 1000, anchor_ngram=4)).score
    assert asked is not None and asked.anchor == AnchorRule(4, 64, 4, 16, 0.5)
    with pytest.raises(ValueError):
        SpecPrefillConfig(anchor_ngram=8, anchor_query_tokens=4)

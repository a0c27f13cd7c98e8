"""SpecPrefill (issue 7): chunk selection, sparse prefill at original positions, scoring between
engine steps, the scorer actor's fallbacks, and what the wire reports.

Every model here is a real float32 fixture; the draft is a fixture with the target's tokenizer.
Exactness: the engine's sparse rows return the tokens of `sparse_greedy_reference` (the kept
tokens in one forward at their original positions, then decoding at the true positions), and a
selection that keeps everything returns exactly plain greedy decoding.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.engine.lane import sparse_row
from mlx_relay.engine.models.loader import load_model
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.messages.specprefill import ScorePlan, SparsePrefill
from mlx_relay.specprefill.selection import kept_positions, select_chunks
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.reference import greedy_reference, sparse_greedy_reference


def long_prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


# -- selection (pure) ----------------------------------------------------------------------------


def test_selection_keeps_first_last_and_the_top_chunks() -> None:
    scores = [0.0] * 100
    for i in range(40, 50):
        scores[i] = 5.0  # chunk 4 (of 10)
    for i in range(70, 80):
        scores[i] = 3.0  # chunk 7
    sel = select_chunks(scores, start=0, chunk_size=10, keep_fraction=0.4).sparse
    assert sel.ranges == [(0, 10), (40, 50), (70, 80), (90, 100)]
    assert sel.kept == 40


def test_selection_keeps_the_dense_head_and_merges_neighbours() -> None:
    scores = [1.0] * 50 + [0.0] * 50
    sel = select_chunks(scores, start=30, chunk_size=10, keep_fraction=0.5).sparse
    # 5 of 10 chunks: the first, the last, and 3 of the 4 middle ones tying at 1.0 (the earliest win);
    # the head [0, 30) is always kept
    assert sel.ranges == [(0, 70), (120, 130)]
    assert kept_positions(sel)[:3] == [0, 1, 2] and kept_positions(sel)[-1] == 129


@pytest.mark.parametrize("n,chunk,keep", [(1000, 64, 0.2), (1000, 64, 0.3), (8192, 64, 0.3), (130, 64, 0.1)])
def test_selection_size(n: int, chunk: int, keep: float) -> None:
    rng = random.Random(n)
    sel = select_chunks([rng.random() for _ in range(n)], start=0, chunk_size=chunk, keep_fraction=keep).sparse
    chunks = math.ceil(n / chunk)
    assert sel.ranges[0][0] == 0 and sel.ranges[-1][1] == n
    kept_chunks = max(2, math.ceil(keep * chunks)) if chunks > 2 else chunks
    assert sel.kept <= kept_chunks * chunk and sel.kept >= (kept_chunks - 1) * chunk


def test_keep_everything_is_one_range() -> None:
    assert select_chunks([0.1] * 500, start=7, chunk_size=16, keep_fraction=1.0).sparse.ranges == [(0, 507)]


def test_sparse_row_positions_and_decode_offset() -> None:
    prompt = list(range(100, 200))
    tokens, kw, snaps = sparse_row(prompt, SparsePrefill([(0, 20), (50, 60), (90, 100)]), 16, [10, 20, 55])
    assert tokens == prompt[:20] + prompt[50:60] + prompt[90:]
    assert kw["rope_delta"] == 100 - 40
    assert kw["positions"].shape == (3, 1, 40) and kw["positions"][0, 0, 20].item() == 50
    assert snaps == [10, 20]  # only inside the dense head
    for bad in ([(0, 20), (10, 30), (90, 100)], [(0, 20), (50, 60)], [(0, 10), (90, 100)]):
        with pytest.raises(ValueError):
            sparse_row(prompt, SparsePrefill(bad), 16 if bad[0][1] == 10 else 0, [])  # type: ignore[arg-type]


# -- the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(gpu: Callable, fp32_model: Path) -> Any:
    return gpu(lambda: load_model(fp32_model))


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_sparse_rows_equal_the_sparse_reference(gpu: Callable, loaded: Any, fp32_model: Path,
                                                prefix_cache: bool) -> None:
    prompt = long_prompt(300, seed=1)
    selections = [SparsePrefill([(0, 300)]),  # everything: must be plain greedy decoding
                  SparsePrefill([(0, 40), (100, 164), (250, 300)]),
                  SparsePrefill([(0, 10), (200, 300)])]

    def run() -> dict[int, list[int]]:
        d = Driver(loaded, prefix_cache=prefix_cache, prefill_step_size=32)
        sids = [d.add(Generate(f"r{i}", prompt, SamplingParams(max_tokens=24), sparse=s))
                for i, s in enumerate(selections)]
        d.add(Generate("dense", prompt, SamplingParams(max_tokens=24)))  # decodes beside them
        d.run()
        return {sid: d.tokens[sid] for sid in sids}

    got = gpu(run)
    assert got[0] == gpu(lambda: greedy_reference(fp32_model, [prompt], 24))[0]
    for sid, sel in enumerate(selections):
        want = gpu(lambda s=sel: sparse_greedy_reference(fp32_model, prompt, kept_positions(s), 24))
        assert got[sid] == want, f"selection {sid}"
    assert got[1] != got[0]  # the dropped tokens matter: the test would see a wrong position


def test_scoring_runs_between_decode_steps(gpu: Callable, loaded: Any, fp32_model: Path) -> None:
    """A long prompt's draft scoring and its sparse prefill advance one chunk per engine step:
    a request already decoding gets a token at every one of those steps."""
    step = 32
    prompt = long_prompt(640, seed=2)

    def run() -> tuple[int, int, int, list[int], list[int]]:
        d = Driver(loaded, prefix_cache=True, prefill_step_size=step, mtp_max_batch=0,
                   specprefill_draft=str(fp32_model))
        a = d.add(Generate("a", [7, 8, 9, 10], SamplingParams(max_tokens=200)))
        while not d.tokens[a]:
            d.step()
        before, steps0 = len(d.tokens[a]), d.steps
        # scored, selected and prefilled in one visit to the engine
        b = d.add(Generate("b", prompt, SamplingParams(max_tokens=8), score=ScorePlan(0, 0.3, 16, 8)))
        while "b" not in d.scored:
            d.step()
        scoring_steps = d.steps - steps0
        outcome = d.scored["b"]
        assert outcome.report.ran and outcome.report.fallback is None and outcome.sparse is not None
        sel = outcome.sparse
        while not d.tokens[b]:
            d.step()
        total_steps = d.steps - steps0
        got_a = len(d.tokens[a]) - before
        d.run()
        return scoring_steps, total_steps, got_a, d.tokens[b], kept_positions(sel)

    scoring_steps, total_steps, got_a, tokens_b, kept = gpu(run)
    assert scoring_steps == math.ceil(len(prompt) / step)  # one draft chunk per step
    assert got_a >= total_steps - 1  # the decoding request moved at (nearly) every step
    assert len(kept) < 0.4 * len(prompt)
    assert tokens_b == gpu(lambda: sparse_greedy_reference(fp32_model, prompt, kept, 8))

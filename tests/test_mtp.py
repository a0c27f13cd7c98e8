"""MTP speculative decoding on the text path (issue 4.3), on the real tiny checkpoints.

Exactness: with MTP on, greedy output equals plain single-sequence decoding with the raw
mlx-vlm loop, for rows that arrive at different times, leave at different times and accept
different numbers of drafts (float32 fixtures: `fp32` has a random head that is almost never
right, `bigram` a head that is almost always right). Sampling: speculative sampling keeps the
target's distribution. Routing: opt-outs, images and rows past `mtp_max_batch` decode without it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.engine.models.loader import load_model
from mlx_relay.messages.gpu import Finished, Generate, SamplingParams
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.reference import greedy_reference
from tests.conftest import References


@pytest.fixture(scope="module")
def bigram_model() -> Path:
    return fixture_path(FixtureSpec(variant="bigram", seed=0))


def run_engine(loaded: Any, plan: list[tuple[int, Generate]], **engine_kw: Any) -> tuple[dict[int, list[int]],
                                                                                    dict[int, Finished], Any]:
    """Feed `plan` (step at which each request arrives) through an EngineCore; collect tokens."""
    d = Driver(loaded, prefix_cache=False, **engine_kw)
    step = 0
    while len(d.finished) < len(plan):
        for at, req in plan:
            if at == step:
                d.add(req)
        d.step()
        step += 1
        assert step < 2000
    stats = d.engine.stats()
    d.engine.close()
    return d.tokens, d.finished, stats


PROMPTS = [list(range(5, 5 + n)) for n in (7, 20, 33, 3, 12)]
MAX_TOKENS = [24, 9, 30, 17, 1]  # rows leave at different times; one ends on its first token


@pytest.mark.parametrize(("variant", "block", "verify"), [
    ("fp32", 2, "batched"), ("bigram", 2, "batched"), ("bigram", 3, "batched"), ("fp32", 4, "batched"),
    ("fp32", 2, "exact"), ("bigram", 3, "exact"),
])
def test_mtp_greedy_equals_plain_decoding(gpu: Callable, references: References, variant: str, block: int,
                                          verify: str) -> None:
    """Both verifiers: mlx-vlm's batch-invariant one and one batched forward over the block."""
    path = fixture_path(FixtureSpec(variant=variant, seed=0))

    def run() -> tuple[Any, ...]:
        loaded = load_model(path)
        plan = [(at, Generate(f"r{i}", p, SamplingParams(max_tokens=m)))
                for i, (at, p, m) in enumerate(zip((0, 0, 3, 3, 5), PROMPTS, MAX_TOKENS, strict=True))]
        got = run_engine(loaded, plan, mtp_block_size=block, mtp_verify=verify)
        return got, references(path, PROMPTS, max(MAX_TOKENS))

    (tokens, finished, stats), ref = gpu(run)
    for sid, want in enumerate(ref):
        assert tokens[sid] == want[: MAX_TOKENS[sid]], sid
        assert finished[sid].reason == "length"
    assert stats.mtp_rounds > 0 and stats.mtp_running == 0
    drafted = sum(f.drafts.mtp.drafted for f in finished.values())
    accepted = sum(f.drafts.mtp.accepted for f in finished.values())
    assert drafted == stats.mtp_drafted and accepted == stats.mtp_accepted
    if variant == "bigram":  # the head is right most of the time, and not always: ragged rounds
        assert 0.7 * drafted < accepted < drafted
    # fewer rounds than tokens: each round emitted accepted + 1 tokens per row
    assert stats.mtp_rounds < sum(MAX_TOKENS)


def test_mtp_rows_alongside_plain_rows_and_routing(gpu: Callable, bigram_model: Path) -> None:
    """Opt-outs and rows that start while mtp_max_batch rows run decode in the plain batch in the same steps as MTP
    rows; every row still equals plain decoding."""

    def run() -> tuple[Any, ...]:
        loaded = load_model(bigram_model)
        plan = [(0, Generate("a", PROMPTS[0], SamplingParams(max_tokens=20))),
                (0, Generate("b", PROMPTS[1], SamplingParams(max_tokens=20, mtp=False))),
                (1, Generate("c", PROMPTS[2], SamplingParams(max_tokens=20))),
                (2, Generate("d", PROMPTS[3], SamplingParams(max_tokens=20)))]
        got = run_engine(loaded, plan, mtp_max_batch=3)
        return got, greedy_reference(bigram_model, [PROMPTS[i] for i in range(4)], 20)

    (tokens, finished, _stats), ref = gpu(run)
    assert [tokens[i] for i in range(4)] == ref
    assert finished[0].drafts.mtp.drafted > 0 and finished[2].drafts.mtp.drafted > 0
    assert finished[1].drafts.mtp.drafted == 0  # opted out
    assert finished[3].drafts.mtp.drafted == 0  # 3 rows were running when it started (mtp_max_batch=3)


def test_mtp_off_for_the_whole_engine(gpu: Callable, bigram_model: Path) -> None:
    """MTP off: the head never drafts (the lane may still verify context drafts); with context
    drafts off too, no row speculates at all."""
    def run() -> Any:
        loaded = load_model(bigram_model)
        req = [(0, Generate("a", PROMPTS[0], SamplingParams(max_tokens=8)))]
        return run_engine(loaded, req, mtp=False), run_engine(loaded, req, mtp=False, max_draft_tokens=0)

    (_tokens, finished, _stats), (_tokens0, finished0, stats0) = gpu(run)
    assert finished[0].drafts.mtp.drafted == 0
    assert finished0[0].drafts.mtp.drafted == 0 and finished0[0].drafts.context.drafted == 0 and stats0.mtp_rounds == 0


def test_mtp_row_cancelled_mid_flight(gpu: Callable, bigram_model: Path) -> None:
    def run() -> tuple[Any, ...]:
        loaded = load_model(bigram_model)
        d = Driver(loaded, prefix_cache=False, max_num_seqs=4, prefill_batch_size=2, mtp_max_batch=2)
        d.add(Generate("a", PROMPTS[0], SamplingParams(max_tokens=30)))
        d.add(Generate("b", PROMPTS[1], SamplingParams(max_tokens=30)))
        for _ in range(4):
            d.step()
        d.engine.cancel(0)
        d.run()
        tokens = d.tokens[1]
        d.engine.close()
        return tokens, greedy_reference(bigram_model, [PROMPTS[1]], 30)[0]

    tokens, want = gpu(run)
    assert tokens == want


def _exact_two_token_distribution(path: Path, prompt: list[int], params: SamplingParams,
                                  mask: Callable[[list[int], Any], Any] | None = None
                                  ) -> dict[tuple[int, int], float]:
    """p(t1) p(t2 | t1) after the request's own temperature/top-k processing, by the raw model;
    with `mask(tokens, logits)`, the logits after `tokens` go through it first (a grammar's mask)."""
    import mlx.core as mx
    import mlx_vlm

    from mlx_relay.engine.sampling.row_sampler import processed_logprobs

    model, _ = mlx_vlm.load(str(path))
    lm = model.language_model

    def dist(tokens: list[int]) -> dict[int, float]:
        logits = lm(mx.array([tokens])).logits[:, -1, :]
        if mask is not None:
            logits = mask(tokens, logits)
        p = mx.exp(processed_logprobs(params, logits))[0]
        return {i: float(v) for i, v in enumerate(p.tolist()) if v > 1e-9}

    out: dict[tuple[int, int], float] = {}
    for t1, p1 in dist(prompt).items():
        for t2, p2 in dist([*prompt, t1]).items():
            out[(t1, t2)] = p1 * p2
    return out


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at standard-normal quantile `z` (3.09: p = 0.001), Wilson-Hilferty."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_two_tokens_fit(tokens: dict[int, list[int]], exact: dict[tuple[int, int], float], n: int
                          ) -> Counter[tuple[int, ...]]:
    """The rows' first two tokens (`n` rows) fit `exact` (G-test at p = 0.001), nothing outside it
    (what the target cannot produce); their counts."""
    counts = Counter(tuple(t) for t in tokens.values())
    assert all(len(t) == 2 for t in counts)
    assert set(counts) <= set(exact), set(counts) - set(exact)
    g = 2.0 * sum(c * math.log(c / (n * exact[cell])) for cell, c in counts.items())
    assert g < _chi2_critical(len(exact) - 1), (g, counts.most_common(5))
    return counts


@pytest.mark.parametrize(("variant", "temperature"), [("fp32", 1.0), ("bigram", 1.5)])
def test_mtp_speculative_sampling_keeps_the_target_distribution(gpu: Callable, variant: str,
                                                                 temperature: float) -> None:
    """The second token is decided by the accept/reject walk: with the fp32 fixture's random
    head the draft is (almost) always rejected and the residual draw decides; with the bigram
    head (close to the target) it is almost always accepted. Either way the empirical joint
    distribution of the first two tokens over many seeds fits the exact one: a G-test (the
    likelihood ratio, sharper than the total variation for the same samples) at p = 0.001
    against an always-accept walk, whose second token follows the head instead."""
    path = fixture_path(FixtureSpec(variant=variant, seed=0))
    params = SamplingParams(temperature=temperature, top_k=4, max_tokens=2)
    prompt = PROMPTS[1]
    n = 200

    def run() -> tuple[Any, ...]:
        loaded = load_model(path)
        plan = [(i // 16, Generate(f"s{i}", prompt, SamplingParams(temperature=temperature, top_k=4, max_tokens=2,
                                                                  seed=i)))
                for i in range(n)]
        # the head's drafts only (context drafts: tests/test_context_drafts.py)
        tokens, _finished, stats = run_engine(loaded, plan, max_num_seqs=16, mtp_max_batch=16, mtp_block_size=2,
                                              speculation="mtp")
        return tokens, stats, _exact_two_token_distribution(path, prompt, params)

    tokens, stats, exact = gpu(run)
    assert stats.mtp_drafted == n
    assert stats.mtp_accepted > 0.9 * n if variant == "bigram" else stats.mtp_accepted < 0.1 * n
    counts = assert_two_tokens_fit(tokens, exact, n)
    tv = 0.5 * sum(abs(counts.get(cell, 0) / n - p) for cell, p in exact.items())
    assert tv < 0.2, tv  # sampling noise for 16 cells at n = 200 is about 0.1

"""Decode priority (issue 30.6, `engine/step/interleave.py`): while rows decode, prefill runs
within a share of the time, from the engine's own measured step costs.

The policy is pure arithmetic over the durations the engine feeds it, so its tests feed it
durations (numbers in, token counts out; nothing here reads a clock). The engine test, on the
float32 fixture, counts what each step allowed and ran: with rows decoding, no step runs more
prefill than the policy allowed and a step it holds back runs none; with none decoding, the
prompts get the whole budget; the long prompt still finishes; outputs equal plain greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.config import EngineConfig
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.scheduling.token_budget import fair_shares, split_by_rows
from mlx_relay.engine.step.interleave import DecodePriority, decode_priority
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.reference import greedy_reference


def _run(policy: DecodePriority, steps: int, *, decode_s: float, token_s: float, fixed_s: float = 0.0,
         budget: int = 256) -> list[int]:
    """`steps` steps of rows decoding beside waiting prompts, each step costing `decode_s` plus,
    when it prefills n tokens, `fixed_s + n * token_s`: the prefill tokens of each step."""
    ran = []
    for _ in range(steps):
        n = policy.allowance(budget)
        policy.observe(decode_s + (fixed_s + n * token_s if n else 0.0), 2, n)
        ran.append(n)
    return ran


def test_prefill_takes_its_share_of_the_time() -> None:
    p = DecodePriority(factor=3.0, min_chunk=16)
    p.observe(0.012, 2, 0)  # a decode step: 12 ms
    # cheap prefill (1 ms a token, no fixed cost): every step prefills what (3 - 1) x 12 ms buys
    ran = _run(p, 50, decode_s=0.012, token_s=0.001)
    assert ran[:2] == [16, 0]  # the first prefill measures the chunk cost (and is paid back)
    # then what 24 ms buys every step, but a step after 32 that measures the decode alone
    assert ran[2:34] == [24] * 32 and ran[34] == 0 and ran[35:] == [24] * 15, ran
    assert p.cost.line() == (0.0, pytest.approx(0.001))
    # prefill 4 ms a token and 30 ms a call (a prompt alone ran a 256-token chunk first): chunks
    # of the fewest tokens that pay their fixed cost (30 ms at most a quarter: 23) every few steps,
    # never a burst, and over the run the prefill's time is (3 - 1) x the decode steps' time
    p = DecodePriority(factor=3.0, min_chunk=16)
    p.observe(0.030 + 256 * 0.004, 0, 256)
    p.observe(0.012, 2, 0)
    ran = _run(p, 400, decode_s=0.012, token_s=0.004, fixed_s=0.030)
    fixed, per_token = p.cost.line()
    assert fixed == pytest.approx(0.030) and per_token == pytest.approx(0.004)
    assert ran[:3] == [0, 0, 16]  # the line through the alone chunk only: no fixed part yet
    assert p.smallest_chunk(256) == 23 and set(ran[3:]) == {0, 23}
    prefill_s = sum(0.030 + n * 0.004 for n in ran if n)
    assert 0.8 * 2 * 400 * 0.012 <= prefill_s <= 1.05 * 2 * 400 * 0.012
    assert p.held == ran.count(0)


def test_a_chunk_with_a_large_fixed_cost_runs_large_and_seldom() -> None:
    """An H200's shape (benchmarks/results/prefill-h200-2026-11-28/): a decode step 21 ms, a chunk
    ~60 ms before its first token and 0.11 ms a token beyond, a step's prefill up to 4,096 tokens.
    Priced by its tokens alone the prefill ran 16-token chunks, each nearly all fixed cost (a 30K
    prompt 36x slower); with the fixed part fitted, chunks big enough to pay it, as often as the
    factor allows."""
    decode_s, fixed_s, token_s = 0.021, 0.060, 0.00011
    p = DecodePriority(factor=2.0, min_chunk=16)
    p.observe(fixed_s + 4096 * token_s, 0, 4096)  # the prompt alone before the streams came
    p.observe(decode_s, 8, 0)
    ran = _run(p, 2000, decode_s=decode_s, token_s=token_s, fixed_s=fixed_s, budget=4096)
    chunks = [n for n in ran if n]
    assert min(chunks[1:]) >= p.smallest_chunk(4096) >= 3 * fixed_s / token_s  # fixed cost <= a quarter
    prefill_s = sum(fixed_s + n * token_s for n in chunks)
    assert 0.8 * 2000 * decode_s <= prefill_s <= 1.05 * 2000 * decode_s  # (2 - 1) x the decode time
    # at least 0.75 of what the prefill's time buys at the largest chunk's cost a token
    assert sum(chunks) >= 0.75 * prefill_s / (fixed_s / 4096 + token_s)
    # where 16-token chunks in the same time would have prefilled a twentieth of it
    assert sum(chunks) > 20 * prefill_s / (fixed_s + 16 * token_s) * 16


def test_a_short_prompt_waits_only_for_its_own_cost() -> None:
    """The H200's shape again, short prompts arriving while rows decode (short_chat at c=16): held
    for credit worth the efficient chunk (~1,600 tokens, 4 x the fixed cost), each waited ~14 steps
    (TTFT 5.3x on an H200, benchmarks/results/gpu-h200-2026-11-29g/); told that a prompt finishes
    with 200 tokens, the step runs those 200 once the credit covers them, and a long prompt (no
    finishing count, or one over the efficient chunk) is held for its efficient chunk as before."""
    decode_s, fixed_s, token_s = 0.017, 0.060, 0.00011

    def primed() -> DecodePriority:
        p = DecodePriority(factor=2.0, min_chunk=16)
        p.observe(fixed_s + 4096 * token_s, 0, 4096)
        p.observe(fixed_s + 256 * token_s, 0, 256)
        p.observe(decode_s, 8, 0)
        return p

    def steps_until_prefill(p: DecodePriority, finishing: int | None) -> tuple[int, int]:
        for step in range(1, 100):
            if n := p.allowance(4096, finishing):
                return step, n
            p.observe(decode_s, 8, 0)
        raise AssertionError("the prefill was held for 100 steps")

    held_for_chunk = steps_until_prefill(primed(), None)
    assert held_for_chunk[1] >= primed().smallest_chunk(4096) >= 1600
    steps, tokens = steps_until_prefill(primed(), 200)
    assert tokens >= 200 and steps == -(-(fixed_s + 200 * token_s) // decode_s)  # its own cost's credit
    assert steps * 3 <= held_for_chunk[0]
    assert steps_until_prefill(primed(), 5000) == held_for_chunk  # no shorter than the efficient chunk


def test_prompts_alone_and_off() -> None:
    p = DecodePriority(factor=3.0, min_chunk=16)
    assert p.allowance(256) == 0  # nothing measured yet: a decode step alone first
    p.observe(0.010, 2, 0)
    assert p.allowance(256) == 16  # then a small chunk
    p.observe(0.5, 0, 256)  # no row decoded: no debt; a prompt alone's chunk is measured
    assert p.credit_s == 0.0 and p.cost.line() == (0.0, pytest.approx(0.5 / 256))
    p.observe(0.010 + 0.032, 2, 16)  # beside a decoding row: the chunk less the decode
    fixed, per_token = p.cost.line()
    assert per_token == pytest.approx((0.5 - 0.032) / 240) and fixed == pytest.approx(0.032 - 16 * per_token)
    assert p.credit_s == pytest.approx(-0.032)
    p.observe(0.3, 0, 256)  # a prompt alone again: the debt stays (no credit saved either)
    assert p.credit_s == pytest.approx(-0.032)
    assert decode_priority(None, "cpu", 16) is not None
    assert decode_priority(None, "cuda", 16) is None  # off on a GPU until measured there
    assert decode_priority(0, "cpu", 16) is None
    assert decode_priority(2.0, "cuda", 16).factor == 2.0  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        DecodePriority(factor=1.0)
    with pytest.raises(ValueError):
        EngineConfig(model_path="x", decode_stall_factor=0.5)
    # a budget of 0 holds prefill back in every lane's split
    assert fair_shares([100, 100], 0, 64) == [0, 0]
    assert split_by_rows([2, 1], 0) == [0, 0]


LONG = list(range(3, 603))  # 600 tokens
SHORT = [5, 6, 7, 8, 9]


@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
def test_engine_holds_prefill_for_decoding_rows(gpu: Callable, fp32_model: Path, mtp: bool) -> None:
    budget = 64

    def run() -> tuple[Any, ...]:
        d = Driver(load_model(fp32_model), max_num_batched_tokens=budget, prefill_step_size=64,
                   decode_stall_factor=3.0)
        long = d.add(Generate("long", LONG, SamplingParams(max_tokens=2, mtp=mtp)))
        trace = []  # per step: (decoding tokens, prefill allowed, prefill run)

        def step() -> None:
            before = d.engine.prefill_tokens
            d.step()
            decode, allowed = d.engine.shares.last_budget
            trace.append((decode, allowed, d.engine.prefill_tokens - before))

        for _ in range(3):  # the long prompt alone
            step()
        short = d.add(Generate("short", SHORT, SamplingParams(max_tokens=40, mtp=mtp)))
        while long not in d.finished:
            step()
            assert len(trace) < 2000
        held = d.engine.shares.priority.held
        ref = greedy_reference(fp32_model, [SHORT, LONG], 40)
        outs = [d.tokens[short], d.tokens[long]]
        d.run()
        outs[0] = d.tokens[short]
        d.engine.close()
        return trace, held, outs, ref

    trace, held, outs, ref = gpu(run)
    decoding = [(a, r) for dec, a, r in trace if dec]
    assert all(r <= a for a, r in decoding), trace  # never more prefill than allowed
    assert all(r == 0 for a, r in decoding if a == 0), trace  # a held step runs none
    assert held == sum(1 for a, _ in decoding if a == 0)
    assert trace[:3] == [(0, budget, budget)] * 3  # the prompt alone: the whole budget every step
    assert sum(r for _, _, r in trace) >= len(LONG)  # the long prompt went on to its end
    assert outs == [ref[0][:40], ref[1][:2]]

"""The measured MTP policy (issue 17.4): the TextMTPExecutor plans MTP only where a round pays.

A round of block k yields 1 + a(k-1) tokens at acceptance a and costs r plain steps (measured at
warm-up). Pure policy tests on the executor's `plan`, then a live Relay on its default policy:
the warm-up measures r and the plans follow it.
"""

from __future__ import annotations

from pathlib import Path

from mlx_relay.actors.text_mtp_executor import EXPLORE_EVERY, MIN_DRAFTS, TextMTPExecutor
from mlx_relay.chat.output import Drafts, SourceDrafts
from mlx_relay.config import EngineConfig
from mlx_relay.messages.gpu import ModelInfo, SamplingParams, Speculate
from mlx_relay.messages.text_mtp import MTPOutcome, PlanText
from mlx_relay.relay import Relay


def _executor(policy: str = "auto", block: int = 2) -> TextMTPExecutor:
    config = EngineConfig(model_path="m", mtp_block_size=block, mtp_policy=policy)  # type: ignore[arg-type]
    info = ModelInfo(model_path="m", model_type="qwen3_5", backend="cpu", context_length=100, vocab_size=10,
                     eos_token_ids=[1], has_vision=False, has_mtp=True, load_seconds=0.0)
    return TextMTPExecutor(config, info)


def _plans(ex: TextMTPExecutor, n: int) -> list[bool]:
    """Whether the head's drafts were planned, for `n` requests."""
    return [(p := ex.plan(PlanText(f"r{i}", SamplingParams())).speculate) is not None and p.head for i in range(n)]


def test_mtp_is_declined_where_even_a_whole_accepted_block_cannot_pay_for_a_round() -> None:
    ex = _executor()
    assert _plans(ex, 3) == [True] * 3  # not measured yet: as configured
    ex.round_cost = 2.4  # a round of 2 costs 2.4 plain steps: at most 2 tokens per round
    assert _plans(ex, 40) == [False] * 40
    assert "cannot pay" in ex.plan(PlanText("x", SamplingParams())).why
    longer = _executor(block=3)  # 3 tokens per round could pay for 2.4 steps
    longer.round_cost = 2.4
    assert _plans(longer, 3) == [True] * 3
    always = _executor("always")
    always.round_cost = 2.4
    assert _plans(always, 3) == [True] * 3


def test_the_measured_acceptance_decides_and_mtp_is_still_sampled_while_it_does_not_pay() -> None:
    ex = _executor()
    ex.round_cost = 1.5  # pays above acceptance 0.5 at block 2
    assert _plans(ex, 4) == [True] * 4  # fewer than MIN_DRAFTS counted: optimistic
    ex.count(MTPOutcome(Drafts(mtp=SourceDrafts(MIN_DRAFTS, int(0.3 * MIN_DRAFTS)))))
    plans = _plans(ex, 2 * EXPLORE_EVERY)
    assert plans.count(True) == 2  # one in EXPLORE_EVERY keeps measuring
    ex.count(MTPOutcome(Drafts(mtp=SourceDrafts(10 * MIN_DRAFTS, 9 * MIN_DRAFTS))))  # acceptance now ~0.83
    assert _plans(ex, 4) == [True] * 4


def test_each_method_plans_its_sources_and_context_drafts_outlive_a_head_that_does_not_pay() -> None:
    ex = _executor()

    def plan(**kw: object) -> Speculate | None:
        return ex.plan(PlanText("r", SamplingParams(**kw))).speculate  # type: ignore[arg-type]

    assert plan() == Speculate(2, head=True, context=8)  # auto: both; the lane picks per round
    assert plan(speculation="mtp") == Speculate(2, head=True, context=0)
    assert plan(speculation="context") == Speculate(2, head=False, context=8)
    assert plan(speculation="none") is None and plan(speculation="draft") is None
    assert plan(max_draft_tokens=2) == Speculate(2, head=True, context=2)
    assert plan(max_draft_tokens=99) == Speculate(2, head=True, context=8)  # the server's cap
    assert plan(mtp=False) is None  # the old opt-out: no head, and under auto context drafts ride with it
    assert plan(mtp=False, speculation="context") == Speculate(2, head=False, context=8)
    assert plan(grammar="start: /a/") == Speculate(2, head=True, context=0)  # a grammar walks the head's
    assert plan(logprobs=0) is None
    # a seeded sampling row's draws must not depend on timed widths: the head's drafts only
    assert plan(temperature=0.7, seed=3) == Speculate(2, head=True, context=0)
    assert plan(temperature=0.7) == Speculate(2, head=True, context=8)
    ex.round_cost = 2.4  # the head cannot pay: plainly under auto, context drafts alone where asked
    assert plan() is None
    assert plan(speculation="context") == Speculate(2, head=False, context=8)
    assert plan(speculation="mtp") is None


async def test_the_relay_measures_a_rounds_cost_at_warm_up_and_plans_by_it(fp32_model: Path) -> None:
    async with Relay.start(fp32_model, max_num_seqs=4) as relay:
        before = await relay.mtp_stats()
        # the head's drafts only: under auto a round may verify a context proposal instead
        result = await relay.chat([{"role": "user", "content": "hello"}], max_tokens=6, temperature=0,
                                  speculation="mtp")
        after = await relay.mtp_stats()
    cost = before["round_cost"]
    assert cost is not None and cost > 0
    planned = after["planned"] - before["planned"]
    assert planned == (1 if 2 / cost > 1 else 0)
    assert (result.mtp_drafted > 0) == (planned == 1)


async def test_auto_tool_requests_keep_mtp_with_and_without_the_tool_grammar(fp32_model: Path) -> None:
    """`--tool-grammar lazy` (the default) holds auto calls to a grammar, which the MTP round
    applies itself (`engine/lanes/mtp_grammar.py`); `off` leaves auto calls free. Either way a
    request with tools decodes with MTP."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    ask = [{"role": "user", "content": "look it up"}]
    async with Relay.start(fp32_model, max_num_seqs=2, mtp_policy="always", warmup=False,
                           tool_grammar="off") as relay:
        free = await relay.chat(ask, tools=tools, max_tokens=8, temperature=0, speculation="mtp")
    assert free.mtp_drafted > 0
    async with Relay.start(fp32_model, max_num_seqs=2, mtp_policy="always", warmup=False) as relay:
        held = await relay.chat(ask, tools=tools, max_tokens=8, temperature=0)
    assert held.mtp_drafted > 0


def test_the_calibrated_round_cost_is_the_median_steps_a_first_shape_trace_does_not_weigh() -> None:
    """The warm-up's calibration (`warmup.round_cost`): an MTP round against a plain step from their
    steps' medians, so one step that met a first-shape trace (an H200's mean read 5-8 plain steps)
    leaves the ratio as the other steps say; MTP steps are scaled to the rounds they finished."""
    from mlx_relay.engine.step.warmup import round_cost

    plain = [0.010] * 31
    rounds = [0.013] * 15
    assert abs((round_cost(rounds, 15, plain) or 0) - 1.3) < 1e-9
    assert round_cost([1.5, *rounds[1:]], 15, plain) == round_cost(rounds, 15, plain)  # a 1.5 s trace
    assert abs((round_cost(rounds, 10, plain) or 0) - 1.95) < 1e-9  # 15 steps finished 10 rounds
    assert round_cost(rounds[:3], 3, plain) is None

"""The compiled MTP round (issue 17.4) on float32 models whose next token depends on the whole
state: the trained `relay-tiny-coder` (its head is right most of the time and not always, so
rounds accept ragged counts) and the random `fp32` fixture (drafts almost always rejected).
`MTPStep` over `MTPState` emits the greedy tokens of plain decoding, compiled and eager, for a
lone row and a ragged batch that rows join and leave mid-way (block 2 and 3); its on-device cut
stops a row at its first EOS with the state ending exactly there (what a turn snapshot takes).
In the engine (the `bigram` fixture), greedy rows take the compiled round while sampling rows
fall back to the eager one, counted in stats. (The `bigram` fixture's tokens barely depend on the
recurrent state, so it would not catch a wrongly selected GatedDeltaNet state; the direct tests
use the other two models.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.testing.fixtures import FixtureSpec, fixture_path

PROMPTS = [list(range(10, 50)), list(range(60, 75)), list(range(90, 161)), list(range(200, 207))]
TOKENS = 20


@pytest.fixture(scope="module")
def bigram_model() -> Path:
    return fixture_path(FixtureSpec(variant="bigram", seed=0))


def _load(gpu: Callable, path: Path) -> tuple[Any, Any]:
    from mlx_relay.engine.lanes.mtp_head import MTPHead
    from mlx_relay.engine.models.loader import load_model

    def load() -> tuple[Any, Any]:
        lm = load_model(path).model.language_model
        return lm, MTPHead.load(path, lm, exact=False)

    return gpu(load)


@pytest.fixture(scope="module")
def coder(gpu: Callable, tiny_coder: Path) -> tuple[Any, Any]:
    """(language model, MTP head) of relay-tiny-coder, loaded once."""
    return _load(gpu, tiny_coder)


@pytest.fixture(scope="module")
def random_head(gpu: Callable, fp32_model: Path) -> tuple[Any, Any]:
    return _load(gpu, fp32_model)


def _reference(gpu: Callable, lm: Any) -> list[list[int]]:
    """Plain greedy decoding of each prompt through the library's own batch-1 caches."""
    import mlx.core as mx

    def run() -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            cache = lm.make_cache()
            logits = lm(mx.array([prompt]), cache=cache).logits
            tokens: list[int] = []
            for _ in range(TOKENS + 4):
                tokens.append(int(mx.argmax(logits[0, -1]).item()))
                logits = lm(mx.array([[tokens[-1]]]), cache=cache).logits
            out.append(tokens)
        return out

    return gpu(run)


@pytest.fixture(scope="module")
def coder_reference(gpu: Callable, coder: tuple[Any, Any]) -> list[list[int]]:
    return _reference(gpu, coder[0])


@pytest.fixture(scope="module")
def random_reference(gpu: Callable, random_head: tuple[Any, Any]) -> list[list[int]]:
    return _reference(gpu, random_head[0])


def _row(lm: Any, head: Any, prompt: list[int]) -> tuple[Any, int]:
    """A prefilled row as the lane hands it over: its state and first token."""
    from mlx_relay.engine.lanes.mtp_state import MTPState

    state, first = MTPState.prefilled(lm, head, prompt)
    return state, int(first.item())


@pytest.mark.parametrize(("model", "compiled", "block"), [
    ("coder", True, 2), ("coder", False, 2), ("coder", True, 3), ("random", True, 2), ("random", False, 3)])
def test_rounds_emit_plain_greedy_tokens_alone_and_in_a_ragged_batch(request: pytest.FixtureRequest, gpu: Callable,
                                                                      model: str, compiled: bool, block: int) -> None:
    """Row 0 alone for 2 rounds; rows 1, 2 and 3 (other prompt lengths) join, one per round; row 0
    leaves after round 5 (the batch shrinks to its bucket); every row's tokens equal plain decoding."""
    from mlx_relay.engine.lanes.mtp_step import MTPStep

    lm, head = request.getfixturevalue("coder" if model == "coder" else "random_head")
    reference = request.getfixturevalue(f"{model}_reference")

    def run() -> tuple[dict[int, list[int]], dict[int, int], int, int]:
        step = MTPStep(lm, head, block_size=block, eos_token_ids=[], compiled=compiled)
        state, first = _row(lm, head, PROMPTS[0])
        rows, out, reached = [0], {0: [first]}, {}
        drafted = accepted = 0
        for r in range(40):
            if r in (2, 3, 4):
                joining = r - 1
                other, tok = _row(lm, head, PROMPTS[joining])
                state.extend(other)
                rows.append(joining)
                out[joining] = [tok]
            if r == 5:
                state.filter([1, 2, 3])
                rows = rows[1:]
            room = [max(TOKENS - len(out[i]), 1) for i in rows]
            res = step(state, room)
            targets, acc, m = res.targets.tolist(), res.accepted.tolist(), res.committed.tolist()
            step.advance(state, m)
            for j, i in enumerate(rows):
                out[i] += targets[j][:m[j] + 1]
                if len(out[i]) >= TOKENS:
                    reached.setdefault(i, len(out[i]))
                drafted += block - 1
                accepted += min(acc[j], m[j] + 1)
            if all(len(out[i]) >= TOKENS for i in rows) and r > 5:
                break
        return out, reached, drafted, accepted

    out, reached, drafted, accepted = gpu(run)
    assert len(out[0]) >= 6  # row 0 left after 5 rounds of at least one token each
    for i in range(4):
        assert out[i] == reference[i][:len(out[i])], i
    assert reached == {1: TOKENS, 2: TOKENS, 3: TOKENS}  # the cut at room: never past max_tokens
    if model == "coder":
        assert 0.3 * drafted < accepted < drafted  # ragged rounds: accepted and rejected drafts
    else:
        assert accepted < 0.2 * drafted


def test_a_row_stops_at_its_first_eos_and_its_state_ends_there(gpu: Callable, coder: tuple[Any, Any],
                                                               coder_reference: list[list[int]]) -> None:
    """With a reference token declared EOS, the round cuts the row right after it (on device), the
    row's committed length is prompt + emitted - 1, and its handed-back caches continue exactly as
    the library's decode of the same tokens."""
    import mlx.core as mx

    from mlx_relay.engine.lanes.mtp_step import MTPStep

    lm, head = coder
    ref = coder_reference[0]
    stop_at = next(i for i in range(9, TOKENS) if ref[i] not in ref[:i])  # its first occurrence

    def run() -> tuple[list[int], int, list[int]]:
        step = MTPStep(lm, head, block_size=3, eos_token_ids=[ref[stop_at]])
        state, first = _row(lm, head, PROMPTS[0])
        out = [first]
        while out[-1] != ref[stop_at] and len(out) <= TOKENS:
            res = step(state, [100])
            m = res.committed.tolist()
            step.advance(state, m)
            out += res.targets.tolist()[0][:m[0] + 1]
        cache = state.row_caches(0)  # every emitted token but the last
        token, more = out[-1], []
        for _ in range(4):
            token = int(mx.argmax(lm(mx.array([[token]]), cache=cache).logits[0, -1]).item())
            more.append(token)
        return out, state.lengths[0], more

    out, length, more = gpu(run)
    assert out == ref[:stop_at + 1]
    assert length == len(PROMPTS[0]) + len(out) - 1
    assert more == ref[stop_at + 1:stop_at + 5]


def test_engine_greedy_rows_compiled_sampling_rows_eager(gpu: Callable, bigram_model: Path) -> None:
    """In the engine (compile_mtp on), greedy rows of different lengths decode in the compiled
    cohort and equal plain decoding; a sampling row beside them runs eager rounds, counted in
    `mtp_fallback_rounds`; with compile_mtp off nothing is counted and the tokens are the same."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.messages.gpu import Generate, SamplingParams
    from mlx_relay.testing.engine_driver import Driver
    from mlx_relay.testing.reference import greedy_reference

    reference = greedy_reference(bigram_model, PROMPTS[:3], TOKENS)

    def run(compile_mtp: bool) -> tuple[dict[int, list[int]], Any]:
        loaded = load_model(bigram_model)
        d = Driver(loaded, prefix_cache=False, max_num_seqs=4, mtp_max_batch=4, compile_mtp=compile_mtp)
        for i in range(3):
            d.add(Generate(f"g{i}", PROMPTS[i], SamplingParams(max_tokens=TOKENS)))
        d.add(Generate("s", PROMPTS[3], SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=3)))
        d.run()
        stats = d.engine.stats()
        d.engine.close()
        return d.tokens, stats

    for compile_mtp in (True, False):
        tokens, stats = gpu(lambda c=compile_mtp: run(c))
        assert [tokens[i] for i in range(3)] == [r[:TOKENS] for r in reference[:3]]
        assert len(tokens[3]) == TOKENS and stats.mtp_rounds > 0
        assert (stats.mtp_fallback_rounds > 0) == compile_mtp
        assert stats.mtp_fallback_rounds < stats.mtp_rounds


def test_buffers_grow_mid_decode(gpu: Callable, coder: tuple[Any, Any], coder_reference: list[list[int]]) -> None:
    """A row whose KV buffers (target and head) have room for only a few more columns keeps
    decoding exactly as they grow."""
    from mlx_relay.engine.lanes.mtp_step import MTPStep

    lm, head = coder

    def run() -> tuple[list[int], int, int]:
        step = MTPStep(lm, head, block_size=2, eos_token_ids=[])
        state, first = _row(lm, head, PROMPTS[1])
        n, hn = state.lengths[0] + 3, state.head_lengths[0] + 3
        state.kv = [(k[:, :, :n, :], v[:, :, :n, :]) for k, v in state.kv]
        state.head_kv = [(k[:, :, :hn, :], v[:, :, :hn, :]) for k, v in state.head_kv]
        out = [first]
        while len(out) < TOKENS:
            res = step(state, [TOKENS - len(out)])
            m = res.committed.tolist()
            step.advance(state, m)
            out += res.targets.tolist()[0][:m[0] + 1]
        return out, state.cap, state.head_cap

    out, cap, head_cap = gpu(run)
    assert out == coder_reference[1][:TOKENS]
    assert cap > len(PROMPTS[1]) + 3 and head_cap > len(PROMPTS[1]) + 3

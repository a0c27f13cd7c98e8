"""A prefill chunk and decoding rows in one forward (issue 43.3: `models/qwen3_5/mixed.py`) are each
what their own forward gives, float32: the chunk's hidden states and caches those of
`prefill_forward`, the rows' logits and explicit caches those of the decode step, on the dense
fixture and on a mixture-of-experts model (whose experts then route the chunk's and the rows'
positions together), for a lone chunk and for a ragged two-row chunk (one row restored, the other
right-padded) beside a left-padded batch of two decoding rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_decode_step import PROMPTS, _positions, _state
from tests.test_prefill_forward import _close, _states, dense, moe  # noqa: F401 (the fixtures, shared)

TOL = 2e-5


def _decoding(lm: Any) -> tuple[Any, Any]:
    """Two rows decoding (prompts of 40 and 15 tokens: the second left-padded) and their next tokens."""
    import mlx.core as mx

    state, first = _state(lm, PROMPTS[0])
    other, second = _state(lm, PROMPTS[1])
    state.extend(other)
    return state, mx.concatenate([first, second])


def chunk_of(lm: Any, ragged: bool) -> Any:
    """A chunk of 24 positions: one row 40 tokens into its prompt, and (ragged) a second row from
    scratch taking 9 (right-padded), its caches (the family's) prepared as the plain lane's prefill
    does (any family: `tests/test_qwen3_family.py` takes it too)."""
    import mlx.core as mx

    from mlx_relay.engine.lanes.stage_forward import ModelForward
    from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches
    from mlx_relay.engine.models import Chunk, family_of
    from mlx_relay.engine.models.prefill_options import PrefillOptions

    family = family_of(lm)
    prompt = [(13 * i + 5) % 400 + 10 for i in range(64)]
    row = family.make_caches(lm)
    ModelForward(lm, PrefillOptions()).prefill(mx.array([prompt[:40]]), None, row, _positions(0, 40))
    caches = as_batch_caches(row)
    ids, positions = mx.array([prompt[40:64]]), _positions(40, 64)
    if ragged:
        extend_caches(caches, as_batch_caches(family.make_caches(lm)))
        for c in caches:
            c.prepare(lengths=[24, 9], right_padding=[0, 15])
        second = [(7 * i + 3) % 400 + 10 for i in range(9)]
        ids = mx.array([prompt[40:64], second + [0] * 15])
        positions = mx.concatenate([positions, _positions(0, 24)], axis=1)
    mx.eval([c.state for c in caches])
    return Chunk(ids, None, caches, positions)


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("ragged", [False, True], ids=["lone", "ragged"])
def test_a_mixed_forward_is_each_forward_alone(gpu: Callable, request: pytest.FixtureRequest, model: str,
                                               ragged: bool) -> None:
    lm = request.getfixturevalue(model)

    def run() -> tuple[bool, bool, bool, bool]:
        import mlx.core as mx

        from mlx_relay.engine.lanes.decode_step import DecodeStep
        from mlx_relay.engine.models.prefill_options import PrefillOptions
        from mlx_relay.engine.models.qwen3_5.prefill import prefill_forward

        step = DecodeStep(lm, compiled=False)
        options = PrefillOptions()
        # alone: the chunk's forward, then the rows' decode step
        chunk, (state, tokens) = chunk_of(lm, ragged), _decoding(lm)
        hidden_ref = prefill_forward(lm, chunk.ids, None, chunk.caches, chunk.positions, options)
        logits_ref = step(tokens, state)
        if ragged:
            for c in chunk.caches:
                c.finalize()
        refs = (hidden_ref, logits_ref, _states(chunk.caches), state.arrays())
        mx.eval(refs)
        # together
        chunk, (state, tokens) = chunk_of(lm, ragged), _decoding(lm)
        hidden, logits = step.beside(chunk, tokens, state, options)
        if ragged:
            for c in chunk.caches:
                c.finalize()
        mx.eval(hidden, logits, _states(chunk.caches), state.arrays())
        rows = [hidden[0]] if not ragged else [hidden[0], hidden[1, :9]]
        rows_ref = [hidden_ref[0]] if not ragged else [hidden_ref[0], hidden_ref[1, :9]]
        return (all(_close(a, b, TOL) for a, b in zip(rows, rows_ref, strict=True)),
                _close(logits, logits_ref, TOL),
                all(_close(a, b, TOL) for a, b in zip(_states(chunk.caches), refs[2], strict=True)),
                all(_close(a, b, TOL) for a, b in zip(_flat(state.arrays()), _flat(refs[3]), strict=True)))

    assert gpu(run) == (True, True, True, True)


def _flat(tree: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    return [x for _, x in tree_flatten(tree)]


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "two-forwards"])
def test_rows_decoding_beside_a_prefill_emit_greedy_tokens(gpu: Callable, fp32_model: Path, mixed: bool) -> None:
    """The plain lane: two short rows decode while a 300-token prompt prefills in 48-token chunks;
    with mixed steps (the default) their steps ride in the chunks' forwards (counted), otherwise
    two forwards a step (none counted); every output is plain greedy decoding of its prompt."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.messages.gpu import Generate, SamplingParams
    from mlx_relay.testing.engine_driver import Driver
    from mlx_relay.testing.reference import greedy_reference

    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 400))]

    def run() -> tuple[list[list[int]], int, int]:
        d = Driver(load_model(fp32_model), max_num_batched_tokens=48, prefill_step_size=64, mixed_steps=mixed,
                   mtp=False)
        rows = [d.add(Generate(f"r{i}", p, SamplingParams(max_tokens=12))) for i, p in enumerate(prompts[:2])]
        d.step()
        rows.append(d.add(Generate("long", prompts[2], SamplingParams(max_tokens=4))))
        d.run()
        stats = d.engine.stats()
        d.engine.close()
        return [d.tokens[r] for r in rows], stats.mixed_steps, stats.prefill_chunks

    outs, mixed_steps, chunks = gpu(run)
    ref = greedy_reference(fp32_model, prompts, 12)
    assert outs == [ref[0], ref[1], ref[2][:4]]
    assert (mixed_steps >= 5) if mixed else mixed_steps == 0, (mixed_steps, chunks)

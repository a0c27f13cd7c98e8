"""A small chunk's layers compiled per part (`models/qwen3_5/compiled_chunk.py`) compute what the eager
forward computes, float32: a prompt's chunks alone (`prefill_forward`: hidden states and the library's
caches after) and beside decoding rows (`mixed_forward`: the chunk's hidden states and caches, the
rows' logits and explicit caches), on the dense fixture and on a mixture-of-experts model. The route
is taken only where it may be (a multiple of 16 tokens within the bound, no padding, no speculative
history, off by default off a CUDA GPU), and a chunk of a shape met before compiles nothing new."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.test_decode_step import PROMPTS, _positions, _state
from tests.test_prefill_forward import _close, _states, dense, moe  # noqa: F401 (the fixtures, shared)

TOL = 2e-5
PROMPT = [(13 * i + 5) % 400 + 10 for i in range(96)]


def _options(bound: int = 64) -> Any:
    from mlx_relay.engine.models.prefill_options import PrefillOptions

    return PrefillOptions(compiled_max_tokens=bound)


def _prefill(lm: Any, chunks: list[tuple[int, int]], parts: Any) -> tuple[list[Any], list[Any]]:
    """The prompt's `chunks` ([start, end) each) through `prefill_forward`: each chunk's hidden
    states and the caches after the last."""
    import mlx.core as mx

    from mlx_relay.engine.models import family_of
    from mlx_relay.engine.models.qwen3_5.prefill import prefill_forward

    caches = family_of(lm).make_caches(lm)
    hidden = []
    for a, b in chunks:
        hidden.append(prefill_forward(lm, mx.array([PROMPT[a:b]]), None, caches, _positions(a, b), _options(),
                                      parts=parts))
        mx.eval(hidden[-1], _states(caches))
    return hidden, _states(caches)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_prompt_prefilled_in_compiled_chunks_is_the_eager_prefill(gpu: Callable, request: pytest.FixtureRequest,
                                                                    model: str) -> None:
    """Chunks of 32, 48 and 16 tokens (the first from empty caches) compiled, against the same
    chunks with nothing compiled; one compiled part a layer's MLP and one a recurrent mixer, none
    made again for the same shapes."""
    lm = request.getfixturevalue(model)
    chunks = [(0, 32), (32, 80), (80, 96)]

    def run() -> tuple[bool, bool, int, int]:
        from mlx_relay.engine.models.compiled_parts import CompiledParts

        parts = CompiledParts()
        hidden_ref, caches_ref = _prefill(lm, chunks, None)
        hidden, caches = _prefill(lm, chunks, parts)
        layers = lm.model.layers
        made = len(parts)
        _prefill(lm, chunks, parts)  # the same shapes again: nothing new to compile
        expected = len(layers) + sum(1 for layer in layers if layer.is_linear)
        return (all(_close(a, b, TOL) for a, b in zip(hidden, hidden_ref, strict=True)),
                all(_close(a, b, TOL) for a, b in zip(caches, caches_ref, strict=True)),
                made - expected, len(parts) - made)

    assert gpu(run) == (True, True, 0, 0)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_decoding_rows_beside_a_compiled_chunk_are_the_eager_mixed_step(gpu: Callable,
                                                                        request: pytest.FixtureRequest,
                                                                        model: str) -> None:
    """Two rows (one left-padded) decode beside a 32-token chunk 40 tokens into its prompt: the
    compiled mixed step gives the eager one's chunk hidden states and caches, and the rows' logits
    and explicit caches."""
    lm = request.getfixturevalue(model)

    def mixed(parts: Any) -> list[Any]:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from mlx_relay.engine.lanes.decode_step import DecodeStep
        from mlx_relay.engine.memory.batch_caches import as_batch_caches
        from mlx_relay.engine.models import Chunk, family_of

        row = family_of(lm).make_caches(lm)
        _prefill_into(lm, row, 0, 40)
        caches = as_batch_caches(row)
        state, first = _state(lm, PROMPTS[0])
        other, second = _state(lm, PROMPTS[1])
        state.extend(other)
        chunk = Chunk(mx.array([PROMPT[40:72]]), None, caches, _positions(40, 72))
        hidden, logits = DecodeStep(lm, compiled=False).beside(chunk, mx.concatenate([first, second]), state,
                                                                _options(), parts)
        out = [hidden, logits, *_states(caches), *(x for _, x in tree_flatten(state.arrays()))]
        mx.eval(out)
        return out

    def run() -> tuple[bool, int]:
        from mlx_relay.engine.models.compiled_parts import CompiledParts

        parts = CompiledParts()
        got, ref = mixed(parts), mixed(None)
        return all(_close(a, b, TOL) for a, b in zip(got, ref, strict=True)) and len(got) == len(ref), len(parts)

    same, made = gpu(run)
    assert same
    assert made > 0


def _prefill_into(lm: Any, caches: list[Any], a: int, b: int) -> None:
    import mlx.core as mx

    from mlx_relay.engine.models.qwen3_5.prefill import prefill_forward

    mx.eval(prefill_forward(lm, mx.array([PROMPT[a:b]]), None, caches, _positions(a, b), _options(0)), _states(caches))


def test_the_compiled_route_is_taken_only_where_it_may_be(gpu: Callable, dense: Any) -> None:  # noqa: F811
    def run() -> list[bool]:
        from mlx_relay.engine.memory.batch_caches import as_batch_caches
        from mlx_relay.engine.models import family_of
        from mlx_relay.engine.models.compiled_parts import CompiledParts
        from mlx_relay.engine.models.prefill_options import PrefillOptions
        from mlx_relay.engine.models.qwen3_5.compiled_chunk import compiled_route

        parts, caches = CompiledParts(), family_of(dense).make_caches(dense)
        speculating = as_batch_caches(family_of(dense).make_caches(dense))
        for c in speculating:
            if hasattr(c, "start_speculation"):
                c.start_speculation(2)
        return [compiled_route(parts, _options(), caches, 32, False) is parts,
                compiled_route(parts, _options(), caches, 64, False) is parts,
                compiled_route(parts, _options(), caches, 24, False) is None,  # not a multiple of 16
                compiled_route(parts, _options(), caches, 80, False) is None,  # past the bound
                compiled_route(parts, _options(), caches, 32, True) is None,  # a padded row
                compiled_route(None, _options(), caches, 32, False) is None,  # no store: eager
                compiled_route(parts, PrefillOptions(), caches, 32, False) is None,  # the default off a CUDA GPU
                compiled_route(parts, _options(), speculating, 32, False) is None]

    assert gpu(run) == [True] * 8


def test_the_default_bound_compiles_small_chunks_on_a_cuda_gpu_only() -> None:
    from mlx_relay.engine.models.prefill_options import COMPILED_MAX_TOKENS, PrefillOptions

    options = PrefillOptions()
    assert options.compiles(16, cuda=True) and options.compiles(COMPILED_MAX_TOKENS, cuda=True)
    assert not options.compiles(COMPILED_MAX_TOKENS + 16, cuda=True)
    assert not options.compiles(16, cuda=False)
    assert not PrefillOptions(compiled_max_tokens=0).compiles(16, cuda=True)

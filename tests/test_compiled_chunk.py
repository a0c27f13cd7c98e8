"""A small chunk's layers compiled per part (`models/qwen3_5/compiled_chunk.py`) compute what the eager
forward computes, float32: a prompt's chunks alone (`prefill_forward`: hidden states and the library's
caches after) and beside decoding rows (`mixed_forward`: the chunk's hidden states and caches, the
rows' logits and explicit caches), on the dense fixture and on a mixture-of-experts model. The route
is taken only where it may be (a multiple of 16 tokens within the bound, no padding, no speculative
history, off by default off a CUDA GPU), and a chunk of a shape met before compiles nothing new."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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
    from mlx_relay.cli import build_parser, config_from_args
    from mlx_relay.engine.memory.kv_budget import plan
    from mlx_relay.engine.models.prefill_options import COMPILED_MAX_TOKENS, PrefillOptions

    args = build_parser().parse_args(["serve", "m", "--compiled-chunk-tokens", "64"])
    assert config_from_args(args).engine.compiled_chunk_tokens == 64
    assert config_from_args(build_parser().parse_args(["serve", "m"])).engine.compiled_chunk_tokens is None
    _, options = plan({"hidden_size": 64}, limit=1 << 30, weights=0, prefix_cache=0, chunk_tokens=16,
                      experts="library", mtp_head=False, compiled_chunk_tokens=64)
    assert options.compiled_max_tokens == 64  # the engine's prefill options carry it

    options = PrefillOptions()
    assert options.compiles(16, cuda=True) and options.compiles(COMPILED_MAX_TOKENS, cuda=True)
    assert not options.compiles(COMPILED_MAX_TOKENS + 16, cuda=True)
    assert not options.compiles(16, cuda=False)
    assert not PrefillOptions(compiled_max_tokens=0).compiles(16, cuda=True)


def test_after_warm_up_a_long_prompt_beside_decoding_rows_traces_nothing(gpu: Callable, fp32_model: Path) -> None:
    """The plain lane with compiled chunk parts (`--compiled-chunk-tokens 64`, fixed chunk lengths
    16, 32, 48): its warm-up traces the mixed step's parts at every batch size beside every length;
    then two short rows decode while a 300-token prompt prefills beside them in mixed steps, and no
    part is traced again (`CompiledParts.traces`); every output is plain greedy decoding."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.messages.gpu import Generate, SamplingParams
    from mlx_relay.testing.engine_driver import Driver
    from mlx_relay.testing.reference import greedy_reference

    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 400))]

    def run() -> tuple[list[list[int]], int, int, int, int]:
        d = Driver(load_model(fp32_model), max_num_batched_tokens=48, prefill_step_size=48, prefill_batch_size=1,
                   max_num_seqs=4, mtp=False, prefill_shapes="fixed", compiled_chunk_tokens=64)
        parts = d.engine.lanes["plain"].prefill.forward.parts
        d.engine.warmup()
        warmed, called = parts.traces, parts.calls
        rows = [d.add(Generate(f"r{i}", p, SamplingParams(max_tokens=12))) for i, p in enumerate(prompts[:2])]
        d.step()
        rows.append(d.add(Generate("long", prompts[2], SamplingParams(max_tokens=4))))
        d.run()
        mixed = d.engine.stats().mixed_steps
        d.engine.close()
        return [d.tokens[r] for r in rows], warmed, parts.traces - warmed, mixed, parts.calls - called

    outs, warmed, traced_after, mixed, ran = gpu(run)
    ref = greedy_reference(fp32_model, prompts, 12)
    assert outs == [ref[0], ref[1], ref[2][:4]]
    assert warmed > 0 and ran > 0 and traced_after == 0 and mixed >= 5, (warmed, ran, traced_after, mixed)


def test_the_mtp_lane_s_prefill_chunks_are_traced_at_warm_up(gpu: Callable, fp32_model: Path) -> None:
    """The MTP lane prefills a row a chunk at a time, in shares of the step's budget cut to multiples
    of 64 tokens: its warm-up traces those lengths' compiled parts (in the store the lanes share),
    so a 200-token prompt (chunks of 64, 64, 64 and a last 8, eager) traces nothing new."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.messages.gpu import Generate, SamplingParams
    from mlx_relay.testing.engine_driver import Driver
    from mlx_relay.testing.reference import greedy_reference

    prompt = list(range(100, 300))

    def run() -> tuple[list[int], bool, int, int, int]:
        d = Driver(load_model(fp32_model), max_num_batched_tokens=64, prefill_step_size=64, max_num_seqs=2,
                   compiled_chunk_tokens=64)
        lanes = d.engine.lanes
        parts = lanes["mtp"].prefill_forward.parts
        shared = parts is lanes["plain"].prefill.forward.parts
        d.engine.warmup()
        warmed, called = parts.traces, parts.calls
        rid = d.add(Generate("long", prompt, SamplingParams(max_tokens=8)))
        d.run()
        rounds = d.engine.stats().mtp_rounds  # the row ran in the MTP lane
        d.engine.close()
        return d.tokens[rid], shared and rounds > 0, warmed, parts.traces - warmed, parts.calls - called

    tokens, mtp_lane, warmed, traced_after, ran = gpu(run)
    assert tokens == greedy_reference(fp32_model, [prompt], 8)[0]
    assert mtp_lane and warmed > 0 and ran > 0 and traced_after == 0, (mtp_lane, warmed, ran, traced_after)


def test_a_family_that_compiles_no_part_skips_the_mixed_warm_up(gpu: Callable) -> None:
    """The dense Qwen3 family runs its chunks eagerly (it takes no compiled parts): the plain lane's
    mixed warm-up stops after its first step, tracing nothing, and says so (0 shapes)."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.testing.engine_driver import Driver
    from mlx_relay.testing.family_fixtures import family_fixture_path

    def run() -> tuple[int, int]:
        d = Driver(load_model(family_fixture_path("qwen3")), max_num_batched_tokens=48, prefill_step_size=48,
                   max_num_seqs=4, prefill_shapes="fixed", compiled_chunk_tokens=64)
        lane = d.engine.lanes["plain"]
        shapes = lane.warm_mixed(4)
        traces = lane.prefill.forward.parts.traces
        d.engine.close()
        return shapes, traces

    assert gpu(run) == (0, 0)

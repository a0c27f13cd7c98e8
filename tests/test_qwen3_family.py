"""The dense Qwen3 family (`engine/models/qwen3/`) on the float32 fixture (`testing/family_fixtures.py`,
mlx-lm's qwen3 model): our forwards are mlx-lm's own.

- `prefill_forward` over the engine's caches gives mlx-lm's hidden states and keys/values, for a
  prompt in chunks (a single token among them) and for a ragged batch as the plain lane runs it
  (one row restored, its keys left-padded; the other from scratch, right-padded);
- the compiled decode step (`DecodeStep` over `forward_block`) gives mlx-lm's logits at every step
  and its greedy tokens over 24 steps, for a lone row and for three rows of different prompt
  lengths joining at different steps; a block of several positions per row (each row's own
  columns, rotated by offsets or by positions) gives mlx-lm's logits too;
- `mixed_forward` gives what the chunk's forward and the rows' step give apart;
- through the engine: rows in continuous batching and a prefix-cache restore decode exactly as
  mlx-lm's greedy generation, in the plain lane alone (no KV lane; no MTP lane, even with context
  drafts on), with its decode-only steps (the compiled step) and mixed steps counted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.testing.family_fixtures import family_fixture_path
from tests.test_decode_step import ragged_decode
from tests.test_mixed_forward import chunk_of

TOL = 2e-5
STEPS = 24
PROMPTS = [[(7 * i + 3) % 400 + 10 for i in range(40)], [(11 * i + 5) % 400 + 10 for i in range(15)],
           [(13 * i + 1) % 400 + 10 for i in range(71)]]


@pytest.fixture(scope="module")
def path() -> Path:
    return family_fixture_path("qwen3")


@pytest.fixture(scope="module")
def lm(gpu: Callable, path: Path) -> Any:
    from mlx_relay.engine.models.loader import load_model

    return gpu(lambda: load_model(path).model.language_model)


def _close(a: Any, b: Any, tol: float = TOL) -> bool:
    import mlx.core as mx

    return a.shape == b.shape and bool(mx.allclose(a, b, atol=tol, rtol=tol))


def _positions(a: int, b: int) -> Any:
    import mlx.core as mx

    return mx.broadcast_to(mx.arange(a, b, dtype=mx.int32)[None, None, :], (3, 1, b - a))


# -- mlx-lm's own forward: the reference ---------------------------------------------------------


class _LibraryRow:
    """A row through mlx-lm's own forward and caches: its prompt's final hidden states (the model's
    body), its logits after the prompt (the whole model, whose caches the row goes on with)."""

    def __init__(self, lm: Any, prompt: list[int]) -> None:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.lm, self.cache = lm, make_prompt_cache(lm)
        self.hidden = lm.model(mx.array([prompt]), cache=make_prompt_cache(lm))
        self.logits = lm(mx.array([prompt]), cache=self.cache)[0, -1]

    def feed(self, token: int) -> Any:
        """The logits [V] after feeding `token`."""
        import mlx.core as mx

        return self.lm(mx.array([[token]]), cache=self.cache)[0, -1]


def _kv(cache: Any) -> tuple[Any, Any]:
    """An mlx-lm `KVCache`'s keys and values up to its offset (its `state` is the whole buffer)."""
    return cache.keys[..., :cache.offset, :], cache.values[..., :cache.offset, :]


def _library_greedy(lm: Any, prompt: list[int], n: int) -> list[int]:
    import mlx.core as mx

    row = _LibraryRow(lm, prompt)
    token = int(mx.argmax(row.logits).item())
    tokens = []
    for _ in range(n):
        tokens.append(token)
        token = int(mx.argmax(row.feed(token)).item())
    return tokens


def _family(lm: Any) -> Any:
    from mlx_relay.engine.models import family_of

    return family_of(lm)


# -- ours ----------------------------------------------------------------------------------------


def _prefill(lm: Any, prompt: list[int], cuts: tuple[int, ...] = ()) -> tuple[list[Any], Any]:
    """The row's caches after our prefill of `prompt` (in chunks ending at `cuts`), and its first token."""
    import mlx.core as mx

    from mlx_relay.engine.lanes.stage_forward import ModelForward

    caches, forward = _family(lm).make_caches(lm), ModelForward(lm)
    hidden, start = None, 0
    for end in (*cuts, len(prompt)):
        hidden = forward.prefill(mx.array([prompt[start:end]]), None, caches, _positions(start, end))
        start = end
    first = mx.argmax(_family(lm).verify_logits(lm, hidden[:, -1:, :])[:, -1, :], axis=-1).astype(mx.int32)
    mx.eval(first, [c.state for c in caches])
    return caches, first


def _state(lm: Any, prompt: list[int]) -> tuple[Any, Any]:
    from mlx_relay.engine.lanes.decode_state import DecodeState
    from mlx_relay.engine.memory.batch_caches import as_batch_caches

    caches, first = _prefill(lm, prompt, (len(prompt) // 2,))
    return DecodeState.from_batch_caches(as_batch_caches(caches), [0]), first


def test_the_family_serves_qwen3_in_the_plain_lane(gpu: Callable, lm: Any) -> None:
    from mlx_relay.engine.models.library_kv import uses_library_forward

    family = _family(lm)
    assert family.name == "qwen3" and not uses_library_forward(lm)
    assert family.cache_layout(lm) == (False, False)
    assert type(family.make_caches(lm)[0]).__module__ == "mlx_vlm.models.cache"


def test_a_chunked_prompt_prefills_as_mlx_lm(gpu: Callable, lm: Any) -> None:
    """150 tokens in four chunks (70, a single token, 29, 50): every chunk's hidden states and the
    keys and values after it equal mlx-lm's forward through its own caches."""

    def run() -> tuple[bool, bool]:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        from mlx_relay.engine.lanes.stage_forward import ModelForward

        prompt = [(7 * i + 3) % 400 + 10 for i in range(150)]
        ours_cache, ref_cache, forward = _family(lm).make_caches(lm), make_prompt_cache(lm), ModelForward(lm)
        hidden_ok = True
        for a, b in ((0, 70), (70, 71), (71, 100), (100, 150)):
            ids = mx.array([prompt[a:b]])
            ours = forward.prefill(ids, None, ours_cache, _positions(a, b))
            ref = lm.model(ids, cache=ref_cache)
            mx.eval(ours, ref)
            hidden_ok = hidden_ok and _close(ours, ref)
        caches_ok = all(_close(x, y) for c, r in zip(ours_cache, ref_cache, strict=True)
                        for x, y in zip(c.state, _kv(r), strict=True))
        return hidden_ok, caches_ok

    assert gpu(run) == (True, True)


def test_a_ragged_batch_prefills_as_mlx_lm(gpu: Callable, lm: Any) -> None:
    """Two rows in one chunk as the plain lane's `PrefillBatch` runs them: one restored at 24 tokens
    (the other's keys left-padded), the other from scratch and right-padded; each row's hidden
    states and keys equal its lone forward through mlx-lm."""

    def run() -> tuple[bool, bool]:
        import mlx.core as mx

        from mlx_relay.engine.lanes.stage_forward import ModelForward
        from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches

        first, second = PROMPTS[0], PROMPTS[1][:10]
        restored, _ = _prefill(lm, first[:24])
        caches = as_batch_caches(restored)
        extend_caches(caches, as_batch_caches(_family(lm).make_caches(lm)))
        for c in caches:
            c.prepare(lengths=[16, 10], right_padding=[0, 6])
        ids = mx.array([first[24:40], second + [0] * 6])
        positions = mx.concatenate([_positions(24, 40), _positions(0, 16)], axis=1)
        ours = ModelForward(lm).prefill(ids, None, caches, positions)
        for c in caches:
            c.finalize()
        refs = [_LibraryRow(lm, first[:40]), _LibraryRow(lm, second)]
        hidden_ok = _close(ours[0], refs[0].hidden[0, 24:]) and _close(ours[1, :10], refs[1].hidden[0])
        caches_ok = all(_close(x, y) for i, ref in enumerate(refs) for c, r in zip(caches, ref.cache, strict=True)
                        for x, y in zip(c.extract(i).state, _kv(r), strict=True))
        return hidden_ok, caches_ok

    assert gpu(run) == (True, True)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_lone_row_decodes_as_mlx_lm(gpu: Callable, lm: Any, compiled: bool) -> None:
    """Our prefill, then our decode step: at every step the logits of mlx-lm's forward fed the same
    token, and over 24 steps its greedy tokens."""

    def run() -> tuple[list[int], list[int], float]:
        import mlx.core as mx

        from mlx_relay.engine.lanes.decode_step import DecodeStep

        step = DecodeStep(lm, compiled=compiled)
        state, token = _state(lm, PROMPTS[0])
        library = _LibraryRow(lm, PROMPTS[0])
        worst = 0.0
        ours = []
        for _ in range(STEPS):
            ours.append(int(token.item()))
            logits = step(token, state)
            worst = max(worst, float(mx.abs(logits[0] - library.feed(ours[-1])).max()))
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
        return ours, _library_greedy(lm, PROMPTS[0], STEPS), worst

    ours, ref, worst = gpu(run)
    assert ours == ref
    assert worst < 1e-4


def test_three_rows_joining_at_different_steps_decode_as_mlx_lm(gpu: Callable, lm: Any) -> None:
    """Row 0 decodes alone; row 1 joins after 3 steps, row 2 after 6 (other prompt lengths: the
    batch is left-padded; an idle fourth row pads it to its bucket); row 0 and the idle row leave
    after 18. Each row's logits at every step equal its lone mlx-lm decode's, and so do its greedy
    tokens."""

    def run() -> tuple[dict[int, list[int]], list[list[int]], float]:
        # the float batch's loop (`test_decode_step.ragged_decode`), rows joining one at a time
        out, worst, _ = ragged_decode(lm, lambda p: _state(lm, p), lambda p: _LibraryRow(lm, p), STEPS + 6,
                                      prompts=PROMPTS, joins={3: (1,), 6: (2,)}, leave_at=18)
        refs = [_library_greedy(lm, p, len(out[i])) for i, p in enumerate(PROMPTS)]
        return out, refs, worst

    out, refs, worst = gpu(run)
    assert worst < 1e-4
    assert [len(out[i]) for i in range(3)] == [18, STEPS + 3, STEPS]
    assert [out[i] for i in range(3)] == refs


@pytest.mark.parametrize("by", ["offsets", "positions"])
def test_a_block_of_positions_per_row_is_mlx_lms_forward(gpu: Callable, lm: Any, by: str) -> None:
    """`forward_block` over T = 4 positions a row, each row writing its own columns (a left-padded
    batch of two prompts), rotated by per-row offsets or position by position: the logits of
    mlx-lm's forward over the same four tokens."""

    def run() -> tuple[bool, bool]:
        import mlx.core as mx

        from mlx_relay.engine.models.positions import Positions

        a, b = _state(lm, PROMPTS[0]), _state(lm, PROMPTS[1])
        state = a[0]
        state.extend(b[0])
        blocks = [[5, 17, 230, 9], [44, 3, 301, 120]]
        lengths = [len(PROMPTS[0]), len(PROMPTS[1])]
        T, cap = 4, state.cap
        columns = mx.arange(state.idx, state.idx + T)[None, :] + mx.zeros((2, 1), dtype=mx.int32)
        offsets = mx.array(lengths, dtype=mx.int32)
        rotary = mx.broadcast_to((offsets[:, None] + mx.arange(T)[None, :])[None], (3, 2, T))
        col = mx.arange(cap)
        mask = (col[None, None, :] >= state.left_padding[:, None, None]) \
            & (col[None, None, :] <= columns[:, :, None])
        at = Positions.per_row(columns, rotary, mask[:, None], offsets if by == "offsets" else None)
        family = _family(lm)
        h, kv, _, _ = family.forward_block(lm, mx.array(blocks), at, state.kv, [], [], keep_states=True, stage=None)
        logits = family.logits(lm, h)
        refs = []
        for prompt, block in zip((PROMPTS[0], PROMPTS[1]), blocks, strict=True):
            row = _LibraryRow(lm, prompt)
            refs.append(lm(mx.array([block]), cache=row.cache)[0])
        mx.eval(logits, kv)
        return _close(logits[0], refs[0], 1e-4), _close(logits[1], refs[1], 1e-4)

    assert gpu(run) == (True, True)


@pytest.mark.parametrize("ragged", [False, True], ids=["lone", "ragged"])
def test_a_mixed_forward_is_each_forward_alone(gpu: Callable, lm: Any, ragged: bool) -> None:
    """A chunk of 24 positions (one row 40 tokens into its prompt; ragged: a second row from scratch
    taking 9, right-padded) beside two decoding rows (left-padded): the chunk's hidden states and
    caches those of `prefill_forward`, the rows' logits and buffers those of the decode step."""

    def decoding() -> tuple[Any, Any]:
        import mlx.core as mx

        state, first = _state(lm, PROMPTS[0])
        other, second = _state(lm, PROMPTS[1])
        state.extend(other)
        return state, mx.concatenate([first, second])

    def states(caches: list[Any]) -> list[Any]:
        return [x for c in caches for x in c.state[:2]]

    def run() -> tuple[bool, bool, bool, bool]:
        import mlx.core as mx

        from mlx_relay.engine.lanes.decode_step import DecodeStep
        from mlx_relay.engine.models.prefill_options import PrefillOptions

        step, options = DecodeStep(lm, compiled=False), PrefillOptions()
        c, (state, tokens) = chunk_of(lm, ragged), decoding()
        hidden_ref = _family(lm).prefill_forward(lm, c.ids, None, c.caches, c.positions, options)
        logits_ref = step(tokens, state)
        if ragged:
            for cache in c.caches:
                cache.finalize()
        caches_ref, kv_ref = states(c.caches), [x for pair in state.kv for x in pair]
        mx.eval(hidden_ref, logits_ref, caches_ref, kv_ref)
        c, (state, tokens) = chunk_of(lm, ragged), decoding()
        hidden, logits = step.beside(c, tokens, state, options)
        if ragged:
            for cache in c.caches:
                cache.finalize()
        mx.eval(hidden, logits, states(c.caches), state.kv)
        rows = [(hidden[0], hidden_ref[0])] + ([(hidden[1, :9], hidden_ref[1, :9])] if ragged else [])
        return (all(_close(a, b) for a, b in rows), _close(logits, logits_ref),
                all(_close(a, b) for a, b in zip(states(c.caches), caches_ref, strict=True)),
                all(_close(a, b) for a, b in zip([x for pair in state.kv for x in pair], kv_ref, strict=True)))

    assert gpu(run) == (True, True, True, True)


# -- through the engine ------------------------------------------------------------------------


def _mlx_lm_greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's own greedy generation (`generate_step`, its default sampler: argmax), one prompt at a time."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _config = load_model(path)
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=max_tokens)] for p in prompts]


def test_the_engine_serves_qwen3_in_the_plain_lane_as_mlx_lm_generates(gpu: Callable, path: Path) -> None:
    """Rows joining at different steps (continuous batching: prefills of 16 tokens a step beside
    decoding rows), a system-prompt snapshot restored by two of them, and context drafts on (the
    default): every row's tokens are mlx-lm's greedy generation of its prompt; the engine runs the
    plain lane alone, its decode-only steps through the compiled step and its other steps mixed."""
    system = [(37 * i + 11) % 997 + 1 for i in range(21)]
    prompts = [system + [(53 * i + 7) % 991 + 3 for i in range(5)], [(29 * i + 5) % 983 + 2 for i in range(30)],
               system + [(17 * i + 1) % 991 + 3 for i in range(9)], system + [(19 * i + 4) % 991 + 3 for i in range(3)]]
    max_tokens = 20

    def run() -> tuple[Any, ...]:
        from mlx_relay.engine.lanes.plain_lane import PlainLane
        from mlx_relay.engine.models.loader import load_model
        from mlx_relay.messages.gpu import Generate, SamplingParams
        from mlx_relay.messages.prefix_cache import PrefixPlan
        from mlx_relay.testing.engine_driver import Driver

        d = Driver(load_model(path), prefill_step_size=16, speculation="auto")
        assert d.config.compile_decode and d.config.mixed_steps and d.config.max_draft_tokens > 0
        sp = SamplingParams(max_tokens=max_tokens)
        a = d.add(Generate("a", prompts[0], sp, prefix=PrefixPlan(snapshot_at=[len(system)])))
        d.step()
        b = d.add(Generate("b", prompts[1], sp))
        for _ in range(3):
            d.step()
        (snap,) = d.snapshots[a]
        c = d.add(Generate("c", prompts[2], sp, prefix=PrefixPlan(snap.handle, snap.length)))
        for _ in range(2):
            d.step()
        e = d.add(Generate("e", prompts[3], sp, prefix=PrefixPlan(snap.handle, snap.length)))
        d.run()
        lanes = dict(d.engine.lanes)
        stats, steps = d.engine.stats(), d.steps
        traced = lanes["plain"].warm_decode(4) if isinstance(lanes.get("plain"), PlainLane) else 0
        d.engine.close()
        return d, (a, b, c, e), snap, sorted(lanes), stats, steps, traced

    d, sids, snap, lanes, stats, steps, traced = gpu(run)
    assert lanes == ["plain"]  # no KV lane, and no MTP lane for context drafts
    assert [d.tokens[s] for s in sids] == gpu(lambda: _mlx_lm_greedy(path, prompts, max_tokens))
    assert snap.length == len(system)
    assert [d.finished[s].cached_tokens for s in sids] == [0, 0, len(system), len(system)]
    assert stats.mtp_rounds == 0 and stats.context_drafted == 0
    assert stats.mixed_steps >= 2  # decoding rows rode in prefill chunks (the decode step beside them)
    assert steps - stats.prefill_chunks >= max_tokens  # decode-only steps: the compiled step
    assert traced == 3  # the compiled step traced at batch sizes 1, 2 and 4

"""The compiled decode step (issue 17.3) on the float32 fixture: our `DecodeStep` over
`DecodeState` returns the logits (to float32 rounding) and so the greedy tokens of mlx-vlm's own
decode through its caches, compiled and eager, for a lone row and for a ragged batch that rows
join and leave mid-way, and a row's state handed back as library caches (its turn snapshot)
continues exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

PROMPTS = [list(range(10, 50)), list(range(60, 75)), list(range(90, 161))]
STEPS = 12


@pytest.fixture(scope="module")
def lm(gpu: Callable, fp32_model: Path) -> Any:
    from mlx_relay.engine.models.loader import load_model

    return gpu(lambda: load_model(fp32_model).model.language_model)


def _positions(a: int, b: int) -> Any:
    import mlx.core as mx

    return mx.broadcast_to(mx.arange(a, b, dtype=mx.int32)[None, None, :], (3, 1, b - a))


def _prefill(lm: Any, prompt: list[int]) -> tuple[list[Any], Any]:
    """The row's library caches after its prompt, and its first token."""
    import mlx.core as mx

    cache = lm.make_cache()
    out = lm(mx.array([prompt]), cache=cache, position_ids=_positions(0, len(prompt)))
    first = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
    mx.eval(first, [c.state for c in cache])
    return cache, first


def _library_greedy(lm: Any, prompt: list[int], n: int) -> list[int]:
    """The reference: mlx-vlm's decode through its own batch-1 caches."""
    import mlx.core as mx

    cache, token = _prefill(lm, prompt)
    tokens = []
    for i in range(n):
        tokens.append(int(token.item()))
        at = len(prompt) + i
        out = lm(token[:, None], cache=cache, position_ids=_positions(at, at + 1))
        token = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
    return tokens


class _LibraryRow:
    """A row decoding through the library's own caches, fed the tokens our step chose."""

    def __init__(self, lm: Any, prompt: list[int]) -> None:
        self.lm, self.at = lm, len(prompt)
        self.cache, _ = _prefill(lm, prompt)

    def feed(self, token: int) -> Any:
        import mlx.core as mx

        out = self.lm(mx.array([[token]]), cache=self.cache, position_ids=_positions(self.at, self.at + 1))
        self.at += 1
        return out.logits[0, -1, :]


def _state(lm: Any, prompt: list[int]) -> tuple[Any, Any]:
    from mlx_relay.engine.lanes.decode_state import DecodeState
    from mlx_relay.engine.memory.batch_caches import as_batch_caches

    cache, first = _prefill(lm, prompt)
    return DecodeState.from_batch_caches(as_batch_caches(cache), [0]), first


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_a_lone_row_decodes_exactly_as_the_library(gpu: Callable, lm: Any, compiled: bool) -> None:
    import mlx.core as mx

    from mlx_relay.engine.lanes.decode_step import DecodeStep

    def run() -> tuple[list[int], list[int]]:
        step = DecodeStep(lm, compiled=compiled)
        state, token = _state(lm, PROMPTS[0])
        ours = []
        for _ in range(STEPS):
            ours.append(int(token.item()))
            token = mx.argmax(step(token, state), axis=-1).astype(mx.int32)
        return ours, _library_greedy(lm, PROMPTS[0], STEPS)

    ours, ref = gpu(run)
    assert ours == ref


def ragged_decode(lm: Any, make_state: Callable[[list[int]], tuple[Any, Any]],
                  make_row: Callable[[list[int]], Any], steps: int, *, prompts: list[list[int]] = PROMPTS,
                  joins: dict[int, tuple[int, ...]] | None = None, leave_at: int = 7
                  ) -> tuple[dict[int, list[int]], float, int]:
    """Row 0 decodes alone; the rows of `joins` (step -> rows; by default rows 1 and 2 after 3
    steps) join (other lengths: the batch is left-padded), the batch padded with idle rows to its
    bucket; row 0 and the idle rows leave after `leave_at`. Each row's tokens, the largest
    difference of a row's logits from its library row's (`make_row`, fed the same tokens) at any
    step, and the buffers' final size. `make_state(prompt)`: a row's decode state and first token."""
    import mlx.core as mx

    from mlx_relay.engine.lanes import decode_state
    from mlx_relay.engine.lanes.decode_step import DecodeStep

    joins = {3: (1, 2)} if joins is None else joins
    step = DecodeStep(lm)
    state, token = make_state(prompts[0])
    rows, out = [0], {r: [] for r in range(len(prompts))}
    library = {r: make_row(p) for r, p in enumerate(prompts)}
    worst = 0.0
    for t in range(steps):
        if t in joins:
            n = len(rows)
            if state.batch_size > n:  # the idle rows go before others join
                state.filter(list(range(n)))
            token = token[:n]
            for r in joins[t]:
                other, first = make_state(prompts[r])
                state.extend(other)
                rows.append(r)
                token = mx.concatenate([token, first])
            size = decode_state.batch_bucket(len(rows))
            state.pad_to(size)
            token = mx.concatenate([token, mx.zeros((size - len(rows),), dtype=mx.int32)])
        if t == leave_at:
            state.filter([1, 2])
            rows = [1, 2]
            token = token[1:3]
        fed = token.tolist()[:len(rows)]
        logits = step(token, state)
        for i, (r, tok) in enumerate(zip(rows, fed, strict=True)):
            out[r].append(tok)
            worst = max(worst, float(mx.abs(logits[i] - library[r].feed(tok)).max()))
        token = mx.argmax(logits, axis=-1).astype(mx.int32)
    return out, worst, state.cap


def test_a_ragged_batch_that_rows_join_and_leave_decodes_exactly(gpu: Callable, lm: Any) -> None:
    """Rows join and leave a ragged batch (`ragged_decode`): each row's logits at every step equal
    its lone library decode's (so a wrong position, mask or state would show), and so do its greedy
    tokens."""
    from mlx_relay.engine.lanes import decode_state

    def run() -> tuple[dict[int, list[int]], list[list[int]], float, int]:
        out, worst, cap = ragged_decode(lm, lambda p: _state(lm, p), lambda p: _LibraryRow(lm, p), STEPS + 8)
        refs = [_library_greedy(lm, p, len(out[i])) for i, p in enumerate(PROMPTS)]
        return out, refs, worst, cap

    out, refs, worst, cap = gpu(run)
    assert worst < 1e-4
    assert [out[i] for i in range(3)] == refs
    assert cap == decode_state.GROW  # 71-token prompt + 16 steps fit the first buffer


def test_buffers_grow_and_a_row_hands_back_its_state(gpu: Callable, lm: Any) -> None:
    """A row past its buffer's size keeps decoding exactly; a row's state as library caches
    (`row_caches`, what a turn snapshot takes) continues exactly in the library's decode."""
    import mlx.core as mx

    from mlx_relay.engine.lanes.decode_step import DecodeStep

    def run() -> tuple[list[int], list[int], int, int]:
        step = DecodeStep(lm)
        a, token = _state(lm, PROMPTS[2])
        a.kv = [(k[:, :, :a.idx + 2, :], v[:, :, :a.idx + 2, :]) for k, v in a.kv]  # room for 2 steps
        grown = []
        for _ in range(6):
            grown.append(int(token.item()))
            token = mx.argmax(step(token, a), axis=-1).astype(mx.int32)
        cap = a.cap

        b, token_b = _state(lm, PROMPTS[1])
        b.extend(_state(lm, PROMPTS[0])[0])
        tokens = mx.concatenate([token_b, token_b])  # row 1's own tokens do not matter here
        handed: list[int] = []
        for _ in range(6):
            handed.append(int(tokens[0].item()))
            tokens = mx.argmax(step(tokens, b), axis=-1).astype(mx.int32)
        cache = b.row_caches(0)  # six tokens fed; the library continues from there
        token = tokens[:1]
        for i in range(4):
            handed.append(int(token.item()))
            at = len(PROMPTS[1]) + 6 + i
            out = lm(token[:, None], cache=cache, position_ids=_positions(at, at + 1))
            token = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
        return grown, handed, cap, len(PROMPTS[2]) + 2

    grown, handed, cap, first_cap = gpu(run)
    assert cap > first_cap
    assert grown == gpu(lambda: _library_greedy(lm, PROMPTS[2], 6))
    assert handed == gpu(lambda: _library_greedy(lm, PROMPTS[1], 10))

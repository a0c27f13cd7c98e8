"""Pins the library behaviour our adapters rely on (mlx-vlm 0.7.x, tokenizers), so an upgrade
that changes it fails here first. MLX work runs on a GPUThread, as in the server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tokenizers.decoders import DecodeStream

from mlx_relay.engine.step.detokenizer import IncrementalDetokenizer, StopMatcher

T = TypeVar("T")


@pytest.fixture(scope="module")
def loaded(gpu: Callable, fp32_model: Path) -> Any:
    from mlx_relay.engine.models.loader import load_model

    return gpu(lambda: load_model(fp32_model))


def _generator(loaded: Any, completion: int, prefill: int) -> Any:
    from mlx_vlm.generate.ar import BatchGenerator

    return BatchGenerator(loaded.model.language_model, loaded.processor, completion_batch_size=completion,
                          prefill_batch_size=prefill, compute_logprobs=False, greedy_sampling=True)


def _kwargs(loaded: Any, ids: list[int]) -> dict:
    import mlx.core as mx

    emb = loaded.model.get_input_embeddings(mx.array([ids]), None)
    return {k: v for k, v in emb.to_dict().items() if v is not None}


def _pos(a: int, b: int) -> Any:
    """M-RoPE positions [3, 1, b - a] of tokens a..b-1."""
    import mlx.core as mx

    return mx.broadcast_to(mx.arange(a, b, dtype=mx.int32)[None, None, :], (3, 1, b - a))


def _ragged_batch(lm: Any, prompts: list[list[int]], cached: list[int]) -> list[Any]:
    """Batch caches of rows that hold `cached[i]` tokens of `prompts[i]` each (0: empty)."""
    import mlx.core as mx

    from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches

    batch: list[Any] = []
    for p, k in zip(prompts, cached, strict=True):
        c = lm.make_cache()
        if k:
            lm(mx.array([p[:k]]), cache=c, position_ids=_pos(0, k))
        mx.eval([x.state for x in c])
        if batch:
            extend_caches(batch, as_batch_caches(c))
        else:
            batch = as_batch_caches(c)
    return batch


def _steps_until_first_token(gen: Any, uid: int, limit: int = 20) -> int:
    for step in range(1, limit + 1):
        _, responses = gen.next()
        if any(r.uid == uid for r in responses):
            return step
    return limit + 1


def test_batch_generator_needs_headroom_to_admit_while_decoding(gpu: Callable, loaded: Any) -> None:
    """With completion_batch_size == running rows + less than prefill_batch_size, a new prompt
    waits for rows to finish; the raw-loop driver (`bench/rawloop.py`) gives the generator that headroom."""
    prompt = list(range(5, 25))

    def run(completion: int) -> int:
        gen = _generator(loaded, completion, prefill=2)
        try:
            gen.insert([prompt, prompt], max_tokens=[50, 50],
                       prompt_kwargs=[_kwargs(loaded, prompt), _kwargs(loaded, prompt)])
            for _ in range(4):
                gen.next()
            (late,) = gen.insert([prompt], max_tokens=[5], prompt_kwargs=[_kwargs(loaded, prompt)])
            return _steps_until_first_token(gen, late)
        finally:
            gen.close()

    assert gpu(lambda: run(completion=3)) > 20  # starved: 3 - 2 running < prefill_batch_size
    assert gpu(lambda: run(completion=2 + 2)) <= 3  # our headroom: joins within a few steps


def test_batch_generator_requires_inputs_embeds(gpu: Callable, loaded: Any) -> None:
    def run() -> None:
        gen = _generator(loaded, 4, 2)
        try:
            gen.insert([[5, 6, 7]], max_tokens=[2])
            gen.next()
        finally:
            gen.close()

    with pytest.raises(ValueError, match="inputs_embeds"):
        gpu(run)


def test_logits_processors_apply_per_row_and_finished_rows_leave(gpu: Callable, loaded: Any) -> None:
    import mlx.core as mx

    forced = 42

    def force(tokens: mx.array, logits: mx.array) -> mx.array:
        return mx.where(mx.arange(logits.shape[-1]) == forced, 0.0, -mx.inf)[None]

    def run() -> tuple[list[int], list[int], bool]:
        gen = _generator(loaded, 4, 2)
        try:
            p = list(range(5, 15))
            a, b = gen.insert([p, p], max_tokens=[4, 4], prompt_kwargs=[_kwargs(loaded, p), _kwargs(loaded, p)],
                              logits_processors=[[force], []])
            out: dict[int, list[int]] = {a: [], b: []}
            while gen.has_work:
                for r in gen.next()[1]:
                    out[r.uid].append(r.token)
            return out[a], out[b], gen.remove(a)
        finally:
            gen.close()

    forced_row, free_row, removed = gpu(run)
    assert forced_row == [forced] * 4
    assert free_row != [forced] * 4
    assert removed is False  # finished rows were already filtered out by the generator


def test_decode_stream_is_utf8_safe(fp32_model: Path) -> None:
    from mlx_relay.actors.normalizer import load_tokenizer

    tok = load_tokenizer(fp32_model)
    text = "naïve こんにちは 🙂 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, len(tok))
    pieces = [detok.step(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert isinstance(DecodeStream(skip_special_tokens=True), DecodeStream)


def test_stop_matcher_holds_back_partial_stops() -> None:
    m = StopMatcher(("STOP", "</end>"))
    assert m.feed("hello ST") == ("hello ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    m = StopMatcher(("</end>",))
    assert m.feed("a </e") == ("a ", False)
    assert m.feed("x") == ("</ex", False)
    assert m.flush() == ""
    m = StopMatcher(("abc",))
    assert m.feed("xab") == ("x", False)
    assert m.flush() == "ab"


def test_a_ragged_batch_chunk_runs_batched_and_equals_each_row_alone(gpu: Callable, loaded: Any) -> None:
    """`prefill_batch.PrefillBatch` and `batch_caches` rely on: rows with different cached lengths
    merged into batch caches (`BatchKVCache` left-pads the shorter keys), fed one chunk of their own
    tokens at their own positions with `capture_layer_ids=[]`, run as ONE batched forward (the
    cache objects are updated in place; without the argument mlx-vlm runs such a batch row by row
    and replaces them), and each row's logits and next chunk equal that row run alone; `take_rows`
    keeps a row's state, and a lone row's decode step runs in place too (no per-step copies)."""
    import mlx.core as mx

    from mlx_relay.engine.memory.batch_caches import batched, take_rows

    lm = loaded.model.language_model
    prompts = [list(range(10, 50)), list(range(60, 85)), list(range(90, 150))]
    cached = [10, 0, 30]
    n = 12

    def alone(p: list[int], upto: int) -> Any:
        c = lm.make_cache()
        return lm(mx.array([p[:upto]]), cache=c, position_ids=_pos(0, upto)).logits[0, -1]

    def run() -> tuple[list[float], list[float], bool, float, bool]:
        batch = _ragged_batch(lm, prompts, cached)
        objects = [id(c) for c in batch]
        diffs = []
        for step in range(2):
            ids = mx.array([p[k + step * n:k + (step + 1) * n] for p, k in zip(prompts, cached, strict=True)])
            positions = mx.concatenate([_pos(k + step * n, k + (step + 1) * n) for k in cached], axis=1)
            out = lm(ids, cache=batch, **batched(position_ids=positions, return_hidden=True))
            hidden_logits = lm.speculative_logits_from_hidden(out.hidden_states[-1][:, -1:, :])[:, -1]
            diffs.append([float(mx.abs(out.logits[i, -1] - alone(p, k + (step + 1) * n)).max())
                          for i, (p, k) in enumerate(zip(prompts, cached, strict=True))])
            diffs.append([float(mx.abs(hidden_logits - out.logits[:, -1]).max())])
        in_place = [id(c) for c in batch] == objects
        # a lone row's decode step (batch caches of one row) also runs in place
        row = take_rows(batch, [2])
        lone = [id(c) for c in row]
        at = cached[2] + 2 * n
        nxt = lm(mx.array([[prompts[2][at]]]), cache=row, **batched(position_ids=_pos(at, at + 1)))
        taken = float(mx.abs(nxt.logits[0, -1] - alone(prompts[2], at + 1)).max())
        lone_in_place = [id(c) for c in row] == lone
        return [x for d in diffs[0::2] for x in d], [x for d in diffs[1::2] for x in d], in_place, taken, lone_in_place

    row_diffs, head_diffs, in_place, taken, lone_in_place = gpu(run)
    assert max(row_diffs) < 1e-4, row_diffs
    # the same hidden states through the head by the forward and by `speculative_logits_from_hidden`: equal
    # to the CPU BLAS's rounding (a matmul over one position against the forward's over the chunk: 1.2e-6
    # seen once in a loaded fresh-clone suite, 0 usually)
    assert max(head_diffs) < 1e-5
    assert in_place and lone_in_place
    assert taken < 1e-4


def test_a_right_padded_chunk_keeps_padding_out_of_each_rows_state(gpu: Callable, loaded: Any) -> None:
    """`PrefillBatch` relies on: in a chunk where a row's prompt ends early, the batch caches'
    public `prepare(lengths=..., right_padding=...)` keeps the padding out of that row's
    GatedDeltaNet state and conv window, `finalize()` rolls its padded keys into masked left
    padding, and the row's next tokens equal the row run alone. (Only while the recurrent caches
    carry no `left_padding`: `as_batch_caches` drops the zero one an empty cache's merge gives.)"""
    import mlx.core as mx

    from mlx_relay.engine.memory.batch_caches import batched

    lm = loaded.model.language_model
    prompts = [list(range(10, 30)), list(range(60, 67)), list(range(90, 110))]
    cached = [8, 0, 0]

    def alone(p: list[int]) -> Any:
        return lm(mx.array([p]), cache=lm.make_cache(), position_ids=_pos(0, len(p))).logits[0, -1]

    def run() -> list[float]:
        batch = _ragged_batch(lm, prompts, cached)
        takes = [len(p) - k for p, k in zip(prompts, cached, strict=True)]  # 12, 7, 20
        n = max(takes)
        ids = mx.array([p[k:] + [0] * (n - len(p) + k) for p, k in zip(prompts, cached, strict=True)])
        positions = mx.concatenate([_pos(k, k + n) for k in cached], axis=1)
        for c in batch:
            c.prepare(lengths=takes, right_padding=[n - t for t in takes])
        lm(ids, cache=batch, **batched(position_ids=positions))
        for c in batch:
            c.finalize()
        # one more token each: the state after the padded chunk must be each row's own
        nxt = [5, 6, 7]
        deltas = mx.zeros((3, 1), dtype=mx.int32)
        out = lm(mx.array([[t] for t in nxt]), cache=batch, **batched(rope_deltas=deltas))
        return [float(mx.abs(out.logits[i, -1] - alone([*p, nxt[i]])).max()) for i, p in enumerate(prompts)]

    diffs = gpu(run)
    assert max(diffs) < 1e-4, diffs


def test_extending_a_bfloat16_batch_with_an_empty_row_keeps_its_dtype(gpu: Callable) -> None:
    """mlx-vlm 0.7.10's `BatchKVCache.extend` gives a side without keys (a row joining a prefill
    batch before its first chunk) a float32 `mx.array([])`, so the whole batch's bfloat16 keys
    come out float32; `extend_caches` casts them back, exactly (this promotion broke the pipeline
    over NCCL: the stages then disagreed on the hidden state's dtype)."""
    def run() -> None:
        import mlx.core as mx
        from mlx_vlm.models.cache import BatchKVCache, KVCache

        from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches

        def filled() -> Any:
            cache = BatchKVCache.merge([KVCache()])
            k = mx.random.normal((1, 2, 20, 8)).astype(mx.bfloat16)
            cache.update_and_fetch(k, k + 1)
            return cache

        library = filled()
        library.extend(BatchKVCache.merge([KVCache()]))
        assert library.keys.dtype == mx.float32  # the library's behaviour (when it changes, drop the cast)
        ours = filled()
        before = ours.keys[0, :, :20]
        extend_caches([ours], as_batch_caches([KVCache()]))
        assert ours.keys.dtype == ours.values.dtype == mx.bfloat16 and ours.keys.shape[0] == 2
        assert mx.array_equal(ours.keys[0, :, :20], before).item()  # the rows' values, exactly
        empty = as_batch_caches([KVCache()])  # and the other way round: an empty batch takes a row
        extend_caches(empty, [filled()])
        assert empty[0].keys.dtype == mx.bfloat16

    gpu(run)

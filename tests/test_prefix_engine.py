"""Prefix-cache snapshots in the engine (issue 5.2, 5.3), on the float32 fixtures.

A request restored from a snapshot (the system prompt's end, or a whole previous turn) returns
exactly what plain greedy decoding of its full prompt returns, in the MTP lane and in the plain
lane, and rows restored from one snapshot and decoding together never see each other's tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.engine.models.loader import load_model
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.messages.prefix_cache import PrefixPlan
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.reference import greedy_reference

SYSTEM = list(range(5, 45))  # a 40-token "system prompt"
SUFFIXES = [list(range(100, 107)), list(range(200, 219)), [300, 301]]


@pytest.fixture(scope="module")
def bigram_model() -> Path:
    return fixture_path(FixtureSpec(variant="bigram", seed=0))


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp-lane", "plain-lane"])
def test_restored_system_prompt_and_turn_equal_plain_decoding(gpu: Callable, bigram_model: Path, mtp: bool) -> None:
    max_tokens = 12

    def run() -> tuple[Any, ...]:
        d = Driver(load_model(bigram_model))
        first = SYSTEM + SUFFIXES[0]
        sp = SamplingParams(max_tokens=max_tokens, mtp=mtp)
        a = d.add(Generate("a", first, sp, prefix=PrefixPlan(snapshot_at=[len(SYSTEM)], snapshot_turn=True)))
        d.run()
        (system,) = [s for s in d.snapshots[a] if s.kind == "system"]
        (turn,) = [s for s in d.snapshots[a] if s.kind == "turn"]
        # two new conversations on the system prompt, decoding together; then turn 2 of the first
        b = d.add(Generate("b", SYSTEM + SUFFIXES[1], sp, prefix=PrefixPlan(system.handle, system.length)))
        c = d.add(Generate("c", SYSTEM + SUFFIXES[2], sp, prefix=PrefixPlan(system.handle, system.length)))
        d.run()
        turn2 = first + turn.generated + [400, 401, 402]
        e = d.add(Generate("e", turn2, sp, prefix=PrefixPlan(turn.handle, turn.length)))
        d.run()
        prompts = [first, SYSTEM + SUFFIXES[1], SYSTEM + SUFFIXES[2], turn2]
        ref = greedy_reference(bigram_model, prompts, max_tokens)
        stats = d.engine.stats()
        d.engine.close()
        return d, (a, b, c, e), system, turn, ref, stats

    d, sids, system, turn, ref, stats = gpu(run)
    assert [d.tokens[s] for s in sids] == ref
    assert system.length == len(SYSTEM)
    # the turn snapshot covers the prompt and the reply (the MTP lane: all but the reply's last token)
    assert turn.length == len(SYSTEM + SUFFIXES[0]) + len(turn.generated)
    assert turn.generated == d.tokens[sids[0]][: len(turn.generated)]
    assert len(turn.generated) >= max_tokens - 1
    cached = [d.finished[s].cached_tokens for s in sids]
    assert cached == [0, len(SYSTEM), len(SYSTEM), turn.length]
    if mtp:
        assert all(d.finished[s].drafts.mtp.drafted > 0 for s in sids)
    else:
        assert all(d.finished[s].drafts.mtp.drafted == 0 for s in sids)
    assert stats.snapshots >= 2 and stats.snapshot_bytes > 0


def test_snapshot_is_not_changed_by_the_request_it_came_from(gpu: Callable, bigram_model: Path) -> None:
    """Copy on append: the snapshot's KV views still hold the prefix after its source request
    and a restored request both appended to their caches."""

    def run() -> tuple[Any, ...]:
        import numpy as np

        d = Driver(load_model(bigram_model))
        sp = SamplingParams(max_tokens=6, mtp=False)
        a = d.add(Generate("a", SYSTEM + SUFFIXES[0], sp, prefix=PrefixPlan(snapshot_at=[len(SYSTEM)])))
        d.run()
        (snap,) = d.snapshots[a]
        entries = d.engine.snapshots.get(snap.handle).target
        before = [np.array(v[0]) for _, v in entries]  # host copies
        d.add(Generate("b", SYSTEM + SUFFIXES[1], sp, prefix=PrefixPlan(snap.handle, snap.length)))
        d.run()
        after = [v[0] for _, v in d.engine.snapshots.get(snap.handle).target]
        same = all(np.array_equal(x, np.array(y)) for x, y in zip(before, after, strict=True))
        kv_len = {v[0].shape[2] for k, v in entries if k == "kv"}
        d.engine.close()
        return same, kv_len

    same, kv_len = gpu(run)
    assert same and kv_len == {len(SYSTEM)}


@pytest.mark.parametrize("shapes", ["exact", "fixed"])
def test_rows_prefilled_together_equal_rows_alone(gpu: Callable, fp32_model: Path, shapes: str) -> None:
    """Issue 17.1: rows that join together are prefilled together, in one chunk per step, with
    ragged restored lengths (a system snapshot, a whole turn, nothing), each snapshotted at its own
    boundary, and each returns exactly plain greedy decoding of its prompt (float32, random weights,
    so a wrong position, mask or state would show). A request restored from a snapshot taken inside
    such a batch is exact too. Issue 17.6: the same with chunks at fixed lengths (every row
    right-padded up to one, as on a GPU)."""
    max_tokens = 8
    long_cold = list(range(500, 570))

    def run() -> tuple[Any, ...]:
        d = Driver(load_model(fp32_model), prefill_batch_size=4, prefill_step_size=64, prefill_shapes=shapes)
        sp = SamplingParams(max_tokens=max_tokens, mtp=False)
        first = SYSTEM + SUFFIXES[0]
        a = d.add(Generate("a", first, sp, prefix=PrefixPlan(snapshot_at=[len(SYSTEM)], snapshot_turn=True)))
        d.run()
        (system,) = [s for s in d.snapshots[a] if s.kind == "system"]
        (turn,) = [s for s in d.snapshots[a] if s.kind == "turn"]
        turn2 = first + turn.generated + [400, 401, 402]
        before = d.engine.stats()
        prompts = [SYSTEM + SUFFIXES[1], long_cold, turn2, [7, 8, 9, 10, 11]]
        plans = [PrefixPlan(system.handle, system.length), PrefixPlan(snapshot_at=[33]),
                 PrefixPlan(turn.handle, turn.length), None]
        sids = [d.add(Generate(f"r{i}", p, sp, prefix=plan))
                for i, (p, plan) in enumerate(zip(prompts, plans, strict=True))]
        d.run()
        after = d.engine.stats()
        (own,) = d.snapshots[sids[1]]
        again = [*long_cold[:33], 42, 43, 44]
        f = d.add(Generate("f", again, sp, prefix=PrefixPlan(own.handle, own.length)))
        d.run()
        ref = greedy_reference(fp32_model, [*prompts, again], max_tokens)
        d.engine.close()
        return d, [*sids, f], own, turn.length, ref, before, after

    d, sids, own, turn_length, ref, before, after = gpu(run)
    assert [d.tokens[s] for s in sids] == ref
    assert own.length == 33
    assert [d.finished[s].cached_tokens for s in sids] == [len(SYSTEM), 0, turn_length, 0, 33]
    chunks, rows = after.prefill_chunks - before.prefill_chunks, after.prefill_rows - before.prefill_rows
    assert rows / chunks > 2, (chunks, rows)  # the four rows ran together, not one by one


def test_fixed_prefill_shapes_are_few_and_the_warmup_runs_each(gpu: Callable, fp32_model: Path) -> None:
    """Issue 17.6: with fixed shapes a prefill chunk only ever runs at one of a few lengths within
    the token budget, and the warm-up runs every (rows, length) a step can meet, leaving the lane
    empty; a prompt afterwards still decodes exactly."""
    from mlx_relay.engine.lanes.plain_lane import PlainLane
    from mlx_relay.engine.lanes.prefill_batch import chunk_lengths

    assert chunk_lengths(2048) == (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert chunk_lengths(64) == (16, 32, 64)
    assert chunk_lengths(100) == (16, 32, 64, 100)
    assert chunk_lengths(8) == (8,)
    prompt = list(range(3, 90))

    def run() -> tuple[Any, ...]:
        loaded = load_model(fp32_model)
        d = Driver(loaded, prefill_batch_size=3, prefill_step_size=64, prefill_shapes="fixed")
        plain = d.engine.lanes["plain"]
        assert isinstance(plain, PlainLane)
        shapes = plain.prefill.shapes()
        warmed = plain.warm_prefill(loaded.info.vocab_size)
        empty = len(plain.prefill) == 0 and not plain.rows
        sid = d.add(Generate("after", prompt, SamplingParams(max_tokens=6, mtp=False)))
        d.run()
        ref = greedy_reference(fp32_model, [prompt], 6)
        d.engine.close()
        return shapes, warmed, empty, d.tokens[sid], ref

    shapes, warmed, empty, tokens, ref = gpu(run)
    # 3 rows share 64 tokens: 16 each at most; 2 rows 32; 1 row 64
    assert shapes == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (3, 16)]
    assert warmed == len(shapes) and empty
    assert [tokens] == ref


def test_a_drained_engine_gives_a_bursts_buffers_back(gpu: Callable, fp32_model: Path) -> None:
    """MLX keeps freed buffers for reuse up to its cache limit (139 GB of an H200 after 64
    streams); when the engine drains with more than `idle_cache_bytes` cached it clears that
    cache, and below the bound (a lone agent's few buffers) it keeps them."""
    import mlx.core as mx

    def run(bound: int) -> int:
        d = Driver(load_model(fp32_model), idle_cache_bytes=bound)
        for i in range(3):
            d.add(Generate(f"r{i}", list(range(10 + i, 60 + i)), SamplingParams(max_tokens=4, mtp=False)))
        d.run()
        cached = mx.get_cache_memory()
        d.engine.close()
        return cached

    assert gpu(lambda: run(0)) == 0
    assert gpu(lambda: run(1 << 40)) > 0


@pytest.mark.parametrize("lane", ["mtp-lane", "plain-lane", "kv-lane"])
def test_the_prompts_end_is_snapshotted_and_restores_the_next_tool_round(gpu: Callable, bigram_model: Path,
                                                                          lane: str) -> None:
    """Issue 43: a snapshot asked for at the prompt's very end (what an agent's next tool round
    repeats) is taken as the row leaves its prefill, before its first token, beside the whole turn;
    the next round's prompt (the reply as the client sent it back, not as generated, and a tool
    result) restored from it decodes exactly as plain greedy decoding of the whole prompt, and so
    does a third round from the second's end. Two rows finishing their prefill in one chunk (one
    restored, one from scratch: ragged) each leave their own end."""
    from mlx_relay.testing.family_fixtures import family_fixture_path
    from tests.test_families import library_greedy

    kv = lane == "kv-lane"
    path = family_fixture_path("gemma3_text") if kv else bigram_model  # served through the library's forward
    max_tokens = 6

    def run() -> tuple[Any, ...]:
        d = Driver(load_model(path), prefill_step_size=64)
        assert not kv or list(d.engine.lanes) == ["kv"]
        sp = SamplingParams(max_tokens=max_tokens, mtp=lane == "mtp-lane")
        first = SYSTEM + SUFFIXES[0]
        a = d.add(Generate("a", first, sp, prefix=PrefixPlan(snapshot_at=[len(SYSTEM), len(first)],
                                                               snapshot_turn=True)))
        d.run()
        (end,) = [s for s in d.snapshots[a] if s.length == len(first) and not s.generated]
        second = first + [500, 501, 502] + SUFFIXES[2]
        cold = list(range(600, 613))
        b = d.add(Generate("b", second, sp, prefix=PrefixPlan(end.handle, end.length, snapshot_at=[len(second)])))
        c = d.add(Generate("c", cold, sp, prefix=PrefixPlan(snapshot_at=[len(cold)])))
        d.run()
        (end2,) = [s for s in d.snapshots[b] if s.length == len(second)]
        (cold_end,) = [s for s in d.snapshots[c] if s.length == len(cold)]
        third = second + [503, 504] + SUFFIXES[1]
        e = d.add(Generate("e", third, sp, prefix=PrefixPlan(end2.handle, end2.length)))
        again = [*cold, 7, 8]
        f = d.add(Generate("f", again, sp, prefix=PrefixPlan(cold_end.handle, cold_end.length)))
        d.run()
        prompts = [first, second, cold, third, again]
        ref = library_greedy(path, "gemma3_text", prompts, max_tokens) if kv \
            else greedy_reference(path, prompts, max_tokens)
        turns = [s for s in d.snapshots[a] if s.generated]
        d.engine.close()
        return d, (a, b, c, e, f), ref, turns

    d, sids, ref, turns = gpu(run)
    assert [d.tokens[s] for s in sids] == ref
    first, second, cold = len(SYSTEM + SUFFIXES[0]), len(SYSTEM + SUFFIXES[0]) + 3 + len(SUFFIXES[2]), 13
    assert [d.finished[s].cached_tokens for s in sids] == [0, first, 0, second, cold]
    assert len(turns) == 1 and turns[0].length > first  # the whole turn as well

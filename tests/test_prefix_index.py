"""The prefix cache index (issue 5): content keys with media, longest-prefix match, pins, the byte
budget with eviction (never-hit turn snapshots first, then LRU), typed results, per-kind counters;
the store's policy of taking a turn snapshot only where a next turn is likely (issue 15.8); and a
tool loop through the store, each round restoring the previous one while what the loop moved past
is superseded (issue 43)."""

from __future__ import annotations

from typing import cast

import pytest

from mlx_relay.actors.prefix_cache_store import PrefixCacheConfig, PrefixCacheStore
from mlx_relay.cache.prefix_index import Inserted, KindStats, PrefixIndex, Rejected
from mlx_relay.cache.prefix_keys import MediaSpan, PrefixKeys
from mlx_relay.messages.prefix_cache import (
    FreeSnapshots,
    GetPrefixStats,
    Lookup,
    PrefixPlan,
    PrefixStats,
    Release,
    SnapshotTaken,
)
from mlx_relay.messages.prompt import Boundaries
from mlx_relay.runtime import ActorRef

SYSTEM = list(range(100, 300))  # 200 tokens: three full blocks and a tail
PAD = 9  # the image pad token id every image expands to


def test_keys_of_shared_prefixes_agree_at_every_length() -> None:
    a = PrefixKeys([*SYSTEM, 1, 2, 3])
    b = PrefixKeys([*SYSTEM, 4, 5])
    for n in (0, 1, 63, 64, 65, 128, 199, 200):
        assert a.key(n) == b.key(n)
    assert a.key(201) != b.key(201)
    assert a.key(200) != a.key(199)


def test_a_different_image_never_shares_a_key_the_same_image_does() -> None:
    tokens = [1, 2, *([PAD] * 20), 3, 4]
    cat, dog = MediaSpan(2, 22, "aa" * 32), MediaSpan(2, 22, "bb" * 32)
    k_cat, k_cat2, k_dog = PrefixKeys(tokens, [cat]), PrefixKeys(tokens, [cat]), PrefixKeys(tokens, [dog])
    assert k_cat.key(2) == k_dog.key(2)  # before the image
    for n in (3, 22, 24):
        assert k_cat.key(n) == k_cat2.key(n)
        assert k_cat.key(n) != k_dog.key(n)
    assert PrefixKeys(tokens).key(22) != k_cat.key(22)  # raw pad ids are not an image
    with pytest.raises(ValueError):
        PrefixKeys(tokens, [MediaSpan(20, 40, "cc")])


def test_match_takes_the_longest_proper_prefix_and_pins_it() -> None:
    index = PrefixIndex(budget_bytes=1000)
    prompt = PrefixKeys(SYSTEM + list(range(10)))
    assert isinstance(index.insert(PrefixKeys(SYSTEM), 200, handle=1, nbytes=100, kind="system"), Inserted)
    assert isinstance(index.insert(prompt, 205, handle=2, nbytes=100, kind="turn"), Inserted)
    m = index.match(PrefixKeys(SYSTEM + list(range(10)) + [7]))
    assert m.entry is not None and m.entry.handle == 2 and m.entry.length == 205
    other = index.match(PrefixKeys([*SYSTEM, 42, 43]))  # diverges after the system prompt
    assert other.entry is not None and other.entry.handle == 1
    # a prompt equal to a snapshot's prefix still needs one token prefilled: it takes a shorter one
    exact = index.match(PrefixKeys(SYSTEM))
    assert exact.entry is None
    stats = index.stats()
    assert (stats.hits, stats.misses, stats.hit_tokens, stats.pinned) == (2, 1, 405, 2)


def test_lru_eviction_skips_pinned_entries_and_reports_every_freed_handle() -> None:
    index = PrefixIndex(budget_bytes=300)
    keys = [PrefixKeys([i] * 50 + [0]) for i in range(4)]
    for i in range(3):
        assert isinstance(index.insert(keys[i], 50, handle=i, nbytes=100, kind="turn"), Inserted)
    pinned = index.match(keys[0])  # entry 0 is the oldest, but now pinned (and most recently used)
    assert pinned.entry is not None and pinned.entry.handle == 0
    index.match(keys[1])
    index.release(1)  # entry 1 used and released: more recent than 2
    result = index.insert(keys[3], 50, handle=3, nbytes=100, kind="turn")
    assert isinstance(result, Inserted) and [e.handle for e in result.evicted] == [2]
    result = index.insert(PrefixKeys([9] * 50 + [0]), 50, handle=4, nbytes=250, kind="turn")
    # room for 250 needs both unpinned entries gone, and entry 0 is still pinned: refused, but the
    # entries it evicted trying are reported so their snapshots are freed
    assert isinstance(result, Rejected) and result.reason == "over_budget" and result.handle == 4
    assert sorted(e.handle for e in result.evicted) == [1, 3]
    assert index.stats().bytes == 100
    index.release(0)
    assert [e.handle for e in index.flush().entries] == [0]
    assert index.stats().entries == 0 and index.stats().evictions == 4


def test_a_demoted_entry_is_evicted_first() -> None:
    """Preloaded files: each one loaded is demoted below those loaded before it."""
    index = PrefixIndex(budget_bytes=300)
    keys = [PrefixKeys([i] * 50 + [0]) for i in range(4)]
    for i in range(3):
        assert isinstance(index.insert(keys[i], 50, handle=i, nbytes=100, kind="system"), Inserted)
        index.demote(keys[i].key(50))
    assert [e.handle for e in index.entries()] == [2, 1, 0] and index.nbytes == 300
    assert index.get(keys[1].key(50)) is not None and index.get(keys[3].key(50)) is None
    result = index.insert(keys[3], 50, handle=3, nbytes=100, kind="turn")
    assert isinstance(result, Inserted) and [e.handle for e in result.evicted] == [2]


def test_duplicates_and_oversized_snapshots_are_refused_with_their_handle() -> None:
    index = PrefixIndex(budget_bytes=100)
    k = PrefixKeys(SYSTEM)
    assert isinstance(index.insert(k, 200, handle=1, nbytes=60, kind="system"), Inserted)
    dup = index.insert(k, 200, handle=2, nbytes=60, kind="system")
    assert isinstance(dup, Rejected) and dup.reason == "duplicate" and dup.handle == 2
    big = index.insert(k, 150, handle=3, nbytes=101, kind="system")
    assert isinstance(big, Rejected) and big.reason == "over_budget" and big.evicted == []
    assert index.stats().entries == 1


def test_never_hit_turn_snapshots_go_first_then_lru_and_kinds_are_counted() -> None:
    index = PrefixIndex(budget_bytes=400)
    keys = [PrefixKeys([i] * 50 + [0]) for i in range(8)]
    for handle, kind in ((0, "system"), (1, "media"), (2, "turn"), (3, "turn")):
        assert isinstance(index.insert(keys[handle], 50, handle=handle, nbytes=100, kind=kind), Inserted)
    hit = index.match(keys[2])  # turn 2 came back: it is no longer a cold turn
    assert hit.entry is not None and hit.entry.handle == 2
    index.release(2)
    # turn 3 is more recent than the system and media entries, but was never hit: it goes first
    result = index.insert(keys[4], 50, handle=4, nbytes=100, kind="system")
    assert isinstance(result, Inserted) and [e.handle for e in result.evicted] == [3]
    # no cold turn left: least recently used (the system entry 0)
    result = index.insert(keys[5], 50, handle=5, nbytes=100, kind="turn")
    assert isinstance(result, Inserted) and [e.handle for e in result.evicted] == [0]
    # room for 200: the cold turn 5 first, then the least recently used (media 1), not the hit turn 2
    result = index.insert(keys[6], 50, handle=6, nbytes=200, kind="media")
    assert isinstance(result, Inserted) and [e.handle for e in result.evicted] == [5, 1]
    by_kind = index.stats().by_kind
    assert by_kind["turn"] == KindStats(entries=1, bytes=100, inserts=3, hits=1, hit_tokens=50, evictions=2,
                                        evicted_bytes=200)
    assert by_kind["system"] == KindStats(entries=1, bytes=100, inserts=2, hits=0, hit_tokens=0, evictions=1,
                                          evicted_bytes=100)
    assert (by_kind["media"].entries, by_kind["media"].bytes, by_kind["media"].inserts) == (1, 200, 2)
    assert index.stats().evictions == 4


class _NoGPU:
    async def tell(self, msg: object) -> None:
        raise AssertionError(f"nothing to free: {msg!r}")


@pytest.mark.parametrize(("multi_turn", "has_tools", "taken"),
                         [(False, False, False), (True, False, True), (False, True, True)],
                         ids=["one-shot", "multi-turn", "tools"])
async def test_store_plans_turn_snapshots_only_where_a_next_turn_is_likely(multi_turn: bool, has_tools: bool,
                                                                           taken: bool) -> None:
    store = PrefixCacheStore(PrefixCacheConfig(budget_bytes=1 << 20, min_snapshot_tokens=8),
                             cast(ActorRef, _NoGPU()))
    prompt = [*SYSTEM, *range(1, 20)]
    # Qwen-style: the next turn repeats the prompt up to the reply's header (len - 3)
    header = await store.receive(Lookup("a", prompt, boundaries=Boundaries([200], len(prompt) - 3),
                                        multi_turn=multi_turn, has_tools=has_tools), None)
    # exact history rendering: the whole state after the reply, taken by the engine at finish
    whole = await store.receive(Lookup("b", [*prompt, 5], boundaries=Boundaries([200], len(prompt) + 1),
                                       multi_turn=multi_turn, has_tools=has_tools), None)
    assert isinstance(header, PrefixPlan) and isinstance(whole, PrefixPlan)
    assert header.snapshot_at == ([200, len(prompt) - 3] if taken else [200])
    assert whole.snapshot_turn is taken
    stats = await store.receive(GetPrefixStats(), None)
    assert isinstance(stats, PrefixStats) and stats.turns_skipped == (0 if taken else 2)


def test_moved_past_keeps_what_each_next_turn_restores_and_frees_pinned_entries_at_release() -> None:
    """Issue 43: the turn snapshots a tool loop's next prompt has gone past are found (a prefix of
    it, or taken by a request whose whole prompt it extends: a whole turn that came back otherwise),
    except the longest at or before each of the prompt's restore points (its reply header for a
    next user turn; its own end, once that is in); superseded at once, or at the last release
    of a pin."""
    index = PrefixIndex(budget_bytes=1000)
    first = [*SYSTEM, *range(1, 21)]  # 220 tokens; the reply's header ends at 217
    whole = [*first, 7, 8, 9]  # and the reply as generated
    for length, handle, kind, keys in [(200, 1, "system", first), (217, 2, "turn", first), (220, 3, "turn", first),
                                       (223, 4, "turn", whole)]:
        assert isinstance(index.insert(PrefixKeys(keys), length, handle, nbytes=100, kind=kind,  # type: ignore[arg-type]
                                       origin_length=220 if kind == "turn" else 0), Inserted)
    second = [*first, 7, 8, 5, 6]  # the reply came back otherwise, then the tool's result
    keys = PrefixKeys(second)
    restored = index.match(keys).entry
    assert restored is not None and restored.handle == 3  # the previous prompt's end
    points = [217, len(second)]
    # until its own end is in, the previous round's end is what a next round restores: kept
    assert {e.handle for e in index.moved_past(keys, len(second), points)} == {4}
    moved = index.moved_past(keys, len(second), points, incoming=len(second))
    assert {e.handle for e in moved} == {3, 4}  # never the system prompt, never the header
    assert [e.handle for e in index.supersede(moved)] == [4]  # 3 is pinned: out at its release
    assert index.entry(3) is not None and index.entry(4) is None
    gone = index.release(3)
    assert gone is not None and gone.handle == 3 and index.entry(3) is None
    stats = index.stats()
    assert (stats.superseded, stats.superseded_bytes, stats.evictions) == (2, 200, 0)
    assert stats.by_kind["turn"].superseded == 2 and stats.entries == 2


class _Frees:
    def __init__(self) -> None:
        self.handles: list[int] = []

    async def tell(self, msg: object) -> None:
        assert isinstance(msg, FreeSnapshots)
        self.handles += msg.handles


async def test_store_restores_each_round_and_holds_one_round_of_a_long_loop() -> None:
    """A 120-round tool loop through the store, as the engine reports it: each request restores
    the previous one's whole turn where the reply came back as generated (even rounds), its prompt's
    end otherwise; it snapshots its own end and whole turn; what the loop moved past is freed as it
    goes, so four snapshots are held (system prompt, the first reply's header, the last round's
    two) on a budget of ten, and nothing is evicted."""
    gpu = _Frees()
    store = PrefixCacheStore(PrefixCacheConfig(budget_bytes=1000, min_snapshot_tokens=8), cast(ActorRef, gpu))
    prompt = [*SYSTEM, *range(1, 21)]
    header = len(prompt) - 3
    handle = 0
    restored: list[int] = []
    for k in range(120):
        rid = f"r{k}"
        plan = await store.receive(Lookup(rid, prompt, boundaries=Boundaries([200], header, len(prompt)),
                                          multi_turn=k > 0, has_tools=True), None)
        assert isinstance(plan, PrefixPlan) and plan.snapshot_turn
        restored.append(plan.restore_length)
        for length in plan.snapshot_at:
            handle += 1
            await store.receive(SnapshotTaken(rid, handle, length, 100, "system"), None)
        reply = [500 + k, 501, 502]  # its end-of-turn token is not in the whole turn
        handle += 1
        await store.receive(SnapshotTaken(rid, handle, len(prompt) + 2, 100, "turn", reply[:2]), None)
        await store.receive(Release(rid), None)
        sent_back = reply if k % 2 == 0 else [600 + k, 601, 602]
        prompt = [*prompt, *sent_back, 900 + k, 901]
    expected = [0]
    length = len(SYSTEM) + 20
    for k in range(119):
        expected.append(length + 2 if k % 2 == 0 else length)  # the whole turn, or the prompt's end
        length += 5
    assert restored == expected
    stats = await store.receive(GetPrefixStats(), None)
    assert isinstance(stats, PrefixStats)
    assert (stats.system_entries, stats.turn_entries, stats.evictions, stats.rejected) == (1, 3, 0, 0)
    assert stats.inserts == 2 + 2 * 120 and stats.by_kind["turn"].superseded == 2 * 119
    assert len(gpu.handles) == len(set(gpu.handles)) == 2 * 119 and stats.bytes == 4 * 100

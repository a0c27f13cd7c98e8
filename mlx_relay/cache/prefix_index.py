"""The PrefixCacheStore's index: which prompt prefixes have an exact state snapshot, under a byte
budget (pure Python; the snapshots themselves live on the GPU executor's thread as handles).

Hybrid models (GatedDeltaNet + attention) cannot trim recurrent state, so a snapshot is reusable
only for prompts that start with exactly its prefix: an entry is (prefix key, length, handle,
bytes). `match` returns the longest entry that is a proper prefix of the prompt (at least one
prompt token must remain to be prefilled, which yields the first logits) and pins it; `release`
unpins. Eviction never frees a pinned entry (a snapshot a request is being restored from) and
goes in two tiers: first turn snapshots that were never hit (a conversation that did not come
back; least recently used first), then least-recently-used over every other unpinned entry.
Results are typed, as in SGLang's radix cache: `Match`, `Inserted`, `Rejected`, `Evicted`; every
handle leaving the index is reported exactly once in an `evicted` list so the owner frees it.
Counters are kept per snapshot kind too (`KindStats`: held, inserted, hit, evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import msgspec

from mlx_relay.cache.prefix_keys import PrefixKeys

__all__ = ["KINDS", "Entry", "Evicted", "IndexStats", "Inserted", "KindStats", "Match", "PrefixIndex", "Rejected",
           "SnapshotKind"]

SnapshotKind = Literal["system", "media", "turn"]
KINDS: tuple[SnapshotKind, ...] = ("system", "media", "turn")


class Entry(msgspec.Struct, frozen=True):
    key: bytes
    length: int  # prompt tokens the snapshot covers
    handle: int  # the GPU executor's snapshot id
    nbytes: int
    kind: SnapshotKind


class Match(msgspec.Struct, frozen=True):
    """`entry` None: a miss. Otherwise the entry is pinned until `release(entry.handle)`."""

    entry: Entry | None


class Inserted(msgspec.Struct, frozen=True):
    entry: Entry
    evicted: list[Entry]  # freed to make room (the owner frees their handles)


class Rejected(msgspec.Struct, frozen=True):
    reason: Literal["duplicate", "over_budget"]
    handle: int  # the offered snapshot, not kept: the owner frees it
    evicted: list[Entry] = msgspec.field(default_factory=list)  # freed trying to make room


class Evicted(msgspec.Struct, frozen=True):
    entries: list[Entry]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


class KindStats(msgspec.Struct, frozen=True):
    """One snapshot kind's share: held now, and counted since start."""

    entries: int
    bytes: int
    inserts: int
    hits: int  # lookups restored from a snapshot of this kind
    hit_tokens: int
    evictions: int  # flushes included
    evicted_bytes: int


class _KindCounters(msgspec.Struct):
    inserts: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0


class IndexStats(msgspec.Struct, frozen=True):
    entries: int
    bytes: int
    budget_bytes: int
    pinned: int
    hits: int
    misses: int
    hit_tokens: int
    evictions: int
    evicted_bytes: int
    by_kind: dict[str, KindStats]


class PrefixIndex:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()  # oldest first
        self._by_handle: dict[int, Entry] = {}
        self._pins: dict[int, int] = {}
        self._lengths: dict[int, int] = {}  # length -> entries with that length
        self._hit: set[int] = set()  # handles of held entries some lookup restored from
        self._kind: dict[str, _KindCounters] = {k: _KindCounters() for k in KINDS}
        self._bytes = 0
        self._hits = self._misses = self._hit_tokens = self._evictions = self._evicted_bytes = 0

    # -- lookups ------------------------------------------------------------------------------
    def match(self, keys: PrefixKeys) -> Match:
        """The longest snapshot that is a proper prefix of the prompt, pinned."""
        for length in sorted((n for n in self._lengths if n < len(keys)), reverse=True):
            entry = self._lru.get(keys.key(length))
            if entry is not None:
                self._lru.move_to_end(entry.key)
                self._pins[entry.handle] = self._pins.get(entry.handle, 0) + 1
                self._hit.add(entry.handle)
                self._hits += 1
                self._hit_tokens += entry.length
                counters = self._kind[entry.kind]
                counters.hits += 1
                counters.hit_tokens += entry.length
                return Match(entry)
        self._misses += 1
        return Match(None)

    def peek(self, keys: PrefixKeys) -> Entry | None:
        """What `match` would return, without pinning or counting anything."""
        for length in sorted((n for n in self._lengths if n < len(keys)), reverse=True):
            if (entry := self._lru.get(keys.key(length))) is not None:
                return entry
        return None

    def entry(self, handle: int) -> Entry | None:
        return self._by_handle.get(handle)

    def entries(self) -> list[Entry]:
        """Held entries, least recently used first."""
        return list(self._lru.values())

    def get(self, key: bytes) -> Entry | None:
        """The entry held under `key` (no hit counted, nothing moved)."""
        return self._lru.get(key)

    def demote(self, key: bytes) -> None:
        """Make `key` the least recently used entry (a preloaded file: each one loaded goes
        before the ones loaded earlier, which were used more recently)."""
        if key in self._lru:
            self._lru.move_to_end(key, last=False)

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return self._bytes

    def has(self, keys: PrefixKeys, length: int) -> bool:
        """Whether the prompt's first `length` tokens already have a snapshot (no hit counted)."""
        return length in self._lengths and keys.key(length) in self._lru

    def release(self, handle: int) -> None:
        n = self._pins.get(handle, 0)
        if n <= 1:
            self._pins.pop(handle, None)
        else:
            self._pins[handle] = n - 1

    # -- updates ------------------------------------------------------------------------------
    def insert(self, keys: PrefixKeys, length: int, handle: int, nbytes: int,
               kind: SnapshotKind) -> Inserted | Rejected:
        return self.insert_key(keys.key(length), length, handle, nbytes, kind)

    def insert_key(self, key: bytes, length: int, handle: int, nbytes: int,
                   kind: SnapshotKind) -> Inserted | Rejected:
        """As `insert`, keyed directly (a snapshot restored from disk carries its key)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return Rejected("duplicate", handle)
        if nbytes > self.budget_bytes:
            return Rejected("over_budget", handle)
        evicted = self._evict_until(self.budget_bytes - nbytes)
        if self._bytes + nbytes > self.budget_bytes:  # what is left is pinned
            return Rejected("over_budget", handle, evicted)
        entry = Entry(key, length, handle, nbytes, kind)
        self._lru[key] = entry
        self._by_handle[handle] = entry
        self._lengths[length] = self._lengths.get(length, 0) + 1
        self._bytes += nbytes
        self._kind[kind].inserts += 1
        return Inserted(entry, evicted)

    def flush(self) -> Evicted:
        """Drop every unpinned entry."""
        return Evicted(self._evict_until(0))

    def _evict_until(self, target_bytes: int) -> list[Entry]:
        out: list[Entry] = []
        if self._bytes <= target_bytes:
            return out
        # tier 1: turn snapshots no lookup ever restored from (the conversation did not come
        # back); tier 2: everything else unpinned. Least recently used first within each.
        for cold_only in (True, False):
            for entry in list(self._lru.values()):
                if self._bytes <= target_bytes:
                    break
                if self._pins.get(entry.handle) or (cold_only and not self._cold(entry)):
                    continue
                self._remove(entry)
                out.append(entry)
        self._evictions += len(out)
        self._evicted_bytes += sum(e.nbytes for e in out)
        for e in out:
            counters = self._kind[e.kind]
            counters.evictions += 1
            counters.evicted_bytes += e.nbytes
        return out

    def _cold(self, entry: Entry) -> bool:
        return entry.kind == "turn" and entry.handle not in self._hit

    def _remove(self, entry: Entry) -> None:
        del self._lru[entry.key]
        del self._by_handle[entry.handle]
        self._hit.discard(entry.handle)
        self._bytes -= entry.nbytes
        n = self._lengths[entry.length] - 1
        if n:
            self._lengths[entry.length] = n
        else:
            del self._lengths[entry.length]

    def stats(self) -> IndexStats:
        held = {k: [0, 0] for k in KINDS}
        for e in self._lru.values():
            held[e.kind][0] += 1
            held[e.kind][1] += e.nbytes
        by_kind = {k: KindStats(entries=held[k][0], bytes=held[k][1], inserts=c.inserts, hits=c.hits,
                                hit_tokens=c.hit_tokens, evictions=c.evictions, evicted_bytes=c.evicted_bytes)
                   for k, c in self._kind.items()}
        return IndexStats(entries=len(self._lru), bytes=self._bytes, budget_bytes=self.budget_bytes,
                          pinned=sum(1 for h in self._pins if h in self._by_handle), hits=self._hits,
                          misses=self._misses, hit_tokens=self._hit_tokens, evictions=self._evictions,
                          evicted_bytes=self._evicted_bytes, by_kind=by_kind)

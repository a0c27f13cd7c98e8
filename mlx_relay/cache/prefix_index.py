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

A conversation grows a prefix as a radix cache's path grows: each turn snapshot remembers the
prompt of the request that took it (its origin), and `moved_past` finds the turn snapshots a
later prompt of the same conversation has gone past (those that are prefixes of it, and those
taken by a request whose whole prompt it extends), keeping for each of the prompt's own restore
points (where its next user turn, its next tool round stop repeating it) the longest snapshot
at or before it. `supersede` takes them out ahead of any eviction: at once, or, while a request
is still restoring from one, when its last pin goes (`release` returns it). Counters are kept
per snapshot kind too (`KindStats`: held, inserted, hit, evicted, superseded).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
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
    # the whole prompt of the request that took it: its length and key (0, b"": not known, e.g.
    # a snapshot loaded from disk)
    origin_length: int = 0
    origin: bytes = b""


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
    superseded: int = 0  # taken out because the conversation moved past them (`supersede`)
    superseded_bytes: int = 0


class _KindCounters(msgspec.Struct):
    inserts: int = 0
    hits: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    superseded: int = 0
    superseded_bytes: int = 0


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
    superseded: int  # entries a conversation moved past, taken out ahead of eviction
    superseded_bytes: int
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
        self._doomed: set[int] = set()  # superseded while pinned: taken out at their last release
        self._kind: dict[str, _KindCounters] = {k: _KindCounters() for k in KINDS}
        self._bytes = 0
        self._hits = self._misses = self._hit_tokens = self._evictions = self._evicted_bytes = 0
        self._superseded = self._superseded_bytes = 0

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

    def release(self, handle: int) -> Entry | None:
        """Unpin; the entry if that took it out (it was superseded while pinned): the owner frees it."""
        n = self._pins.get(handle, 0)
        if n > 1:
            self._pins[handle] = n - 1
            return None
        self._pins.pop(handle, None)
        entry = self._by_handle.get(handle)
        if entry is None or handle not in self._doomed:
            return None
        self._take_out(entry)
        return entry

    def moved_past(self, keys: PrefixKeys, prompt_length: int, points: Iterable[int],
                   incoming: int | None = None) -> list[Entry]:
        """The turn snapshots the conversation of a prompt (`keys`, its first `prompt_length` tokens)
        has moved past: those that are prefixes of the prompt, and those a request took whose whole
        prompt this one extends (its whole-turn snapshot included, repeated or not), except, for
        each of `points` (where the prompt's next user turn and next tool round stop repeating
        it), the longest held snapshot of the prompt at or before it, which that turn restores
        (`incoming`: a prompt length about to be inserted, which counts as held). Nothing is
        taken out (`supersede` does)."""
        held = {length: entry for length in self._lengths if length <= prompt_length
                and (entry := self._lru.get(keys.key(length))) is not None}
        found = {e.handle: e for e in held.values() if e.kind == "turn"}
        origins: dict[int, bytes] = {}
        for e in self._lru.values():
            if e.kind != "turn" or not 0 < e.origin_length < prompt_length or e.handle in found:
                continue
            if e.origin_length not in origins:
                origins[e.origin_length] = keys.key(e.origin_length)
            if origins[e.origin_length] == e.origin:
                found[e.handle] = e
        for point in points:
            at = max((n for n in held if n <= point), default=None)
            if at is not None and (incoming is None or not at < incoming <= point):
                found.pop(held[at].handle, None)
        return list(found.values())

    def supersede(self, entries: Iterable[Entry]) -> list[Entry]:
        """Take out entries a conversation moved past, ahead of any eviction: those no request is
        restoring from at once (returned: the owner frees their handles), the others at their last
        `release`."""
        out: list[Entry] = []
        for e in entries:
            if self._by_handle.get(e.handle) is not e:
                continue
            if self._pins.get(e.handle):
                self._doomed.add(e.handle)
            else:
                self._take_out(e)
                out.append(e)
        return out

    def _take_out(self, entry: Entry) -> None:
        self._remove(entry)
        self._superseded += 1
        self._superseded_bytes += entry.nbytes
        counters = self._kind[entry.kind]
        counters.superseded += 1
        counters.superseded_bytes += entry.nbytes

    # -- updates ------------------------------------------------------------------------------
    def insert(self, keys: PrefixKeys, length: int, handle: int, nbytes: int, kind: SnapshotKind,
               origin_length: int = 0) -> Inserted | Rejected:
        """`origin_length`: the whole prompt of the request that took it, a prefix of `keys` (0: not known)."""
        origin = keys.key(origin_length) if origin_length else b""
        return self.insert_key(keys.key(length), length, handle, nbytes, kind, origin_length, origin)

    def insert_key(self, key: bytes, length: int, handle: int, nbytes: int, kind: SnapshotKind,
                   origin_length: int = 0, origin: bytes = b"") -> Inserted | Rejected:
        """As `insert`, keyed directly (a snapshot restored from disk carries its key)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return Rejected("duplicate", handle)
        if nbytes > self.budget_bytes:
            return Rejected("over_budget", handle)
        evicted = self._evict_until(self.budget_bytes - nbytes)
        if self._bytes + nbytes > self.budget_bytes:  # what is left is pinned
            return Rejected("over_budget", handle, evicted)
        entry = Entry(key, length, handle, nbytes, kind, origin_length, origin)
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
        self._doomed.discard(entry.handle)
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
                                hit_tokens=c.hit_tokens, evictions=c.evictions, evicted_bytes=c.evicted_bytes,
                                superseded=c.superseded, superseded_bytes=c.superseded_bytes)
                   for k, c in self._kind.items()}
        return IndexStats(entries=len(self._lru), bytes=self._bytes, budget_bytes=self.budget_bytes,
                          pinned=sum(1 for h in self._pins if h in self._by_handle), hits=self._hits,
                          misses=self._misses, hit_tokens=self._hit_tokens, evictions=self._evictions,
                          evicted_bytes=self._evicted_bytes, by_kind=by_kind, superseded=self._superseded,
                          superseded_bytes=self._superseded_bytes)

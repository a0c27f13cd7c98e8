"""The PrefixCacheStore's index of the snapshot files on disk (pure Python; the files are read and
written elsewhere: `snapshot_files`).

An entry is (prefix key, length, kind, file name, bytes, last use). `match` finds the longest file
whose prefix is a proper prefix of a prompt (longer than what memory already has); loads pin the
entry so it is not deleted while it is read. The byte budget covers the files and the writes
under way (`reserve` before a write, `add` when it landed, `release` when it did not): the
directory never holds more than the budget. Eviction is least recently used first, by last use
(a restore from disk, or a memory hit on a snapshot that is also on disk), never a pinned entry;
every entry leaving the index is returned exactly once so the owner deletes its file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import msgspec

from mlx_relay.cache.prefix_index import SnapshotKind
from mlx_relay.cache.prefix_keys import PrefixKeys

__all__ = ["DiskEntry", "DiskIndex", "DiskIndexStats"]


class DiskEntry(msgspec.Struct, frozen=True):
    key: bytes
    length: int
    kind: SnapshotKind
    name: str  # the file's name in the model's snapshot directory
    nbytes: int
    last_used: float


class DiskIndexStats(msgspec.Struct, frozen=True):
    entries: int
    bytes: int
    budget_bytes: int
    reserved_bytes: int  # writes under way
    pinned: int
    evictions: int
    evicted_bytes: int


class DiskIndex:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[bytes, DiskEntry] = OrderedDict()  # least recently used first
        self._lengths: dict[int, int] = {}
        self._pins: dict[bytes, int] = {}
        self._bytes = self._reserved = 0
        self._evictions = self._evicted_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def get(self, key: bytes) -> DiskEntry | None:
        return self._lru.get(key)

    def entries(self) -> list[DiskEntry]:
        return list(self._lru.values())

    # -- lookups ------------------------------------------------------------------------------
    def match(self, keys: PrefixKeys, above: int = 0) -> DiskEntry | None:
        """The longest file that is a proper prefix of the prompt and longer than `above`."""
        for length in sorted((n for n in self._lengths if above < n < len(keys)), reverse=True):
            entry = self._lru.get(keys.key(length))
            if entry is not None:
                return entry
        return None

    def touch(self, key: bytes, now: float) -> None:
        entry = self._lru.get(key)
        if entry is not None:
            self._lru[key] = msgspec.structs.replace(entry, last_used=max(now, entry.last_used))
            self._lru.move_to_end(key)

    def pin(self, key: bytes) -> None:
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        n = self._pins.get(key, 0)
        if n <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = n - 1

    # -- updates ------------------------------------------------------------------------------
    def load(self, entries: Iterable[DiskEntry]) -> list[DiskEntry]:
        """The files found at start, in last-use order; returns those over the budget (evicted),
        and older files of a key found twice."""
        out: list[DiskEntry] = []
        for entry in sorted(entries, key=lambda e: e.last_used):
            if (old := self.remove(entry.key)) is not None:
                out.append(old)
            self._put(entry)
        return out + self._evict_until(self.budget_bytes)

    def reserve(self, nbytes: int) -> list[DiskEntry] | None:
        """Make room for a write of up to `nbytes`: the entries evicted for it, or None (nothing
        evicted) when it cannot fit (larger than the budget, or the rest is pinned)."""
        if nbytes > self.budget_bytes:
            return None
        if self._bytes + self._reserved + nbytes > self.budget_bytes and (
                self._unpinned_bytes() < self._bytes + self._reserved + nbytes - self.budget_bytes):
            return None
        evicted = self._evict_until(self.budget_bytes - nbytes)
        self._reserved += nbytes
        return evicted

    def release(self, nbytes: int) -> None:
        """A reservation that was not used (the write failed or was dropped)."""
        self._reserved = max(0, self._reserved - nbytes)

    def add(self, entry: DiskEntry, reserved: int) -> list[DiskEntry]:
        """A written file, in place of its reservation; returns what was evicted to fit it (the
        entry itself if it cannot fit, and an older file of the same key it replaces)."""
        self.release(reserved)
        out: list[DiskEntry] = []
        if (old := self.remove(entry.key)) is not None:
            out.append(old)
        self._put(entry)
        self._lru.move_to_end(entry.key)
        out += self._evict_until(self.budget_bytes)
        return out

    def remove(self, key: bytes) -> DiskEntry | None:
        entry = self._lru.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            self._pins.pop(key, None)
            n = self._lengths[entry.length] - 1
            if n:
                self._lengths[entry.length] = n
            else:
                del self._lengths[entry.length]
        return entry

    def _put(self, entry: DiskEntry) -> None:
        self._lru[entry.key] = entry
        self._lengths[entry.length] = self._lengths.get(entry.length, 0) + 1
        self._bytes += entry.nbytes

    def _unpinned_bytes(self) -> int:
        return sum(e.nbytes for k, e in self._lru.items() if not self._pins.get(k))

    def _evict_until(self, target_bytes: int) -> list[DiskEntry]:
        out: list[DiskEntry] = []
        for key, entry in list(self._lru.items()):
            if self._bytes + self._reserved <= target_bytes:
                break
            if self._pins.get(key):
                continue
            self.remove(key)
            out.append(entry)
        self._evictions += len(out)
        self._evicted_bytes += sum(e.nbytes for e in out)
        return out

    def stats(self) -> DiskIndexStats:
        return DiskIndexStats(entries=len(self._lru), bytes=self._bytes, budget_bytes=self.budget_bytes,
                              reserved_bytes=self._reserved, pinned=sum(1 for k in self._pins if k in self._lru),
                              evictions=self._evictions, evicted_bytes=self._evicted_bytes)

"""The prefix cache's disk tier: the part of the PrefixCacheStore actor that decides what goes to
disk and what comes back (policy and index; no arrays, no file contents).

    store --SaveSnapshot--> GPUExecutor (host copy on its thread, file write on a writer thread)
          <--SnapshotSaved--
    store --LoadSnapshot--> GPUExecutor (read + checksum off its thread, checked load on it)
          <--SnapshotLoaded--

What is written: system-prompt and media snapshots as soon as they are taken (shared by every
conversation that starts with them: the first thing a restarted server needs), and any snapshot
the memory tier evicts, except a turn the conversation has already moved past (a later turn was
snapshotted from it). `persist` (a drain) writes what is still only in memory. Files live in one
directory per model (`snapshot_files.namespace_dir`), keyed by the memory tier's content keys,
under a byte budget with LRU over last use (`disk_index.DiskIndex`), last use persisted as the
files' mtimes. At start the directory is scanned (headers only); files of another model, dtype,
library or format version, unreadable or truncated ones are removed and counted. A lookup whose
longest match is on disk (longer than what memory holds) waits for the GPUExecutor to load it,
then goes on as a memory hit; a file that fails a check at load is counted, removed, and the
request prefills as it would have without it.

Preload (`preload`, started by the store once the server is ready): the files are loaded into the
memory tier through the same loads, most recently used first, one at a time, until the next one
would take the memory tier past the store's cap; a lookup meanwhile is answered as ever (a lookup
for the file being preloaded waits for that load, never a second one). Preloaded entries are
ordinary memory entries, their files stay on disk (an eviction does not rewrite them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

import anyio
import msgspec

from mlx_relay.cache.disk_index import DiskEntry, DiskIndex
from mlx_relay.cache.prefix_index import Entry
from mlx_relay.cache.prefix_keys import PrefixKeys
from mlx_relay.cache.snapshot_files import (
    REJECT_REASONS,
    SnapshotIdentity,
    namespace_dir,
    remove_files,
    scan,
    touch_files,
)
from mlx_relay.messages.prefix_cache import (
    DiskStats,
    FreeSnapshots,
    LoadSnapshot,
    Persisted,
    PreloadStats,
    SaveSnapshot,
    SnapshotLoaded,
    SnapshotSaved,
)
from mlx_relay.runtime import ActorRef


class DiskTierConfig(msgspec.Struct, frozen=True):
    root: str  # `--prefix-cache-dir`: the model's files go to a directory of its own under it
    budget_bytes: int  # `--prefix-cache-disk-gb`
    identity: SnapshotIdentity  # what files must match (from the GPUExecutor's ModelInfo)
    load_timeout_s: float = 30.0  # a lookup waits this long for a load, then prefills without it


class _Counters(msgspec.Struct):
    found_at_start: int = 0
    hits: int = 0
    hit_tokens: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    load_errors: int = 0
    writes: int = 0
    written_bytes: int = 0
    copy_seconds: float = 0.0
    write_seconds: float = 0.0
    writes_dropped: int = 0
    write_errors: int = 0
    writes_skipped: int = 0
    temporaries_removed: int = 0
    preload: str = "off"  # PreloadStats.state
    preloaded: int = 0
    preloaded_bytes: int = 0
    preload_seconds: float = 0.0
    preload_left: int = 0
    rejected: dict[str, int] = msgspec.field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))


class _Write(msgspec.Struct):
    reserved: int
    length: int
    kind: str
    done: anyio.Event


class _Load(msgspec.Struct):
    entry: DiskEntry
    done: anyio.Event


class DiskTier:
    """Owned by the PrefixCacheStore; `spawn` runs background file work as the store's task."""

    def __init__(self, config: DiskTierConfig, gpu: ActorRef,
                 spawn: Callable[[Callable[[], Awaitable[None]]], None]) -> None:
        self.config = config
        self.gpu = gpu
        self.spawn = spawn
        self.directory = namespace_dir(config.root, config.identity)
        self.index = DiskIndex(config.budget_bytes)
        self._writing: dict[bytes, _Write] = {}
        self._loading: dict[bytes, _Load] = {}
        self._superseded: set[int] = set()  # memory handles of turns a later turn was taken from
        self._used: set[bytes] = set()  # keys whose last use moved since start (mtimes to persist)
        self._counters = _Counters()

    async def start(self) -> None:
        """Scan the model's directory (headers only) and index what can be used."""
        found = await anyio.to_thread.run_sync(scan, self.directory, self.config.identity)
        c = self._counters
        c.found_at_start, c.temporaries_removed = len(found.files), found.temporaries
        for reason, n in found.rejected.items():
            c.rejected[reason] += n
        evicted = self.index.load(DiskEntry(f.key, f.length, f.kind, f.name, f.nbytes, f.last_used)  # type: ignore[arg-type]
                                  for f in found.files)
        if evicted:
            await anyio.to_thread.run_sync(remove_files, self.directory, [e.name for e in evicted])

    # -- loads ----------------------------------------------------------------------------------
    def candidate(self, keys: PrefixKeys, in_memory: int) -> DiskEntry | None:
        """The longest file for this prompt that beats the `in_memory` match's length."""
        return self.index.match(keys, above=in_memory)

    async def load(self, entry: DiskEntry, *, use: bool = True) -> anyio.Event:
        """Start loading `entry` (once, however many lookups want it); set when it has landed in
        the memory tier (or failed). `use`: a request wants it (its last use moves; a preload's
        load leaves the files' order as it is)."""
        if (under_way := self._loading.get(entry.key)) is not None:
            return under_way.done
        load = self._loading[entry.key] = _Load(entry, anyio.Event())
        self.index.pin(entry.key)
        if use:
            self.index.touch(entry.key, time.time())
        await self.gpu.tell(LoadSnapshot(entry.key, str(self.directory / entry.name), entry.length,
                                         self.config.identity))
        return load.done

    def loaded(self, msg: SnapshotLoaded) -> tuple[DiskEntry | None, anyio.Event | None]:
        """A load ended: the entry to insert into the memory tier (None: it failed, counted, and
        its file removed unless it was only unreadable now), and the event to set once it is in
        (the lookups waiting for it)."""
        load = self._loading.pop(msg.key, None)
        self.index.unpin(msg.key)
        c = self._counters
        c.load_seconds += msg.seconds
        if load is None:
            return None, None
        if msg.error is None:
            c.loads += 1
            return load.entry, load.done
        if msg.error == "io":
            c.load_errors += 1
        else:
            c.rejected[msg.error] += 1
            if (gone := self.index.remove(msg.key)) is not None:
                self._delete([gone.name])
        return None, load.done

    def preload_planned(self) -> None:
        """The store will preload once the server is ready."""
        self._counters.preload = "waiting"

    async def preload(self, fits: Callable[[DiskEntry], bool], held: Callable[[bytes], int | None],
                      landed: Callable[[bytes], None]) -> None:
        """Load the files into the memory tier, most recently used first, one at a time, while
        `fits` (the store's cap); `held`: the bytes the memory tier holds under a key (None: not
        there); `landed`: a preloaded key is in (the store places it in its LRU order). A file
        removed meanwhile, or already in memory, is passed over."""
        c = self._counters
        c.preload = "running"
        tic = time.perf_counter()
        try:
            order = sorted(self.index.entries(), key=lambda e: e.last_used, reverse=True)
            for i, entry in enumerate(order):
                if entry.key not in self.index or held(entry.key) is not None:
                    continue
                if not fits(entry):
                    c.preload_left = sum(1 for e in order[i:] if e.key in self.index and held(e.key) is None)
                    break
                ours = entry.key not in self._loading  # else a lookup's load: waited for, not counted
                done = await self.load(entry, use=False)
                with anyio.move_on_after(self.config.load_timeout_s):
                    await done.wait()
                if ours and (nbytes := held(entry.key)) is not None:
                    c.preloaded += 1
                    c.preloaded_bytes += nbytes
                    landed(entry.key)
        finally:
            c.preload_seconds = time.perf_counter() - tic
            c.preload = "done"

    def hit(self, length: int) -> None:
        self._counters.hits += 1
        self._counters.hit_tokens += length

    def used(self, key: bytes) -> None:
        """A memory hit on a snapshot that is also on disk: its file is used too (LRU)."""
        if key in self.index:
            self.index.touch(key, time.time())
            self._used.add(key)

    # -- writes ---------------------------------------------------------------------------------
    def superseded(self, handle: int) -> None:
        """A later turn was snapshotted from this turn snapshot: not worth a file any more."""
        self._superseded.add(handle)

    def forget(self, handle: int) -> None:
        self._superseded.discard(handle)

    def worth_writing(self, entry: Entry) -> bool:
        return (entry.key not in self.index and entry.key not in self._writing
                and entry.handle not in self._superseded)

    async def save(self, entry: Entry, *, free_after: bool) -> anyio.Event | None:
        """Ask the GPUExecutor to write `entry` (freeing it after if `free_after`); the event is
        set when the write has ended. None: not written (it cannot fit the budget)."""
        evicted = self.index.reserve(entry.nbytes)
        if evicted is None:
            self._counters.writes_skipped += 1
            if free_after:
                await self.gpu.tell(FreeSnapshots([entry.handle]))
            return None
        self._delete([e.name for e in evicted])
        write = self._writing[entry.key] = _Write(entry.nbytes, entry.length, entry.kind, anyio.Event())
        # a write id: every file's bytes (so its checksum, so its name) are its own, and a file
        # deleted late (eviction, rejection) is never a newer file of the same snapshot
        meta = {**self.config.identity.metadata(), "relay.key": entry.key.hex(), "relay.length": str(entry.length),
                "relay.kind": entry.kind, "relay.write": uuid.uuid4().hex}
        await self.gpu.tell(SaveSnapshot(entry.key, entry.handle, entry.nbytes, str(self.directory), meta,
                                         free_after))
        return write.done

    def saved(self, msg: SnapshotSaved) -> None:
        write = self._writing.pop(msg.key, None)
        if write is None:
            return
        c = self._counters
        c.copy_seconds += msg.copy_seconds
        if msg.error is None:
            c.writes += 1
            c.written_bytes += msg.nbytes
            c.write_seconds += msg.write_seconds
            entry = DiskEntry(msg.key, write.length, write.kind, msg.name, msg.nbytes, time.time())  # type: ignore[arg-type]
            evicted = self.index.add(entry, write.reserved)
            self._delete([e.name for e in evicted if e.name != msg.name or e.key not in self.index])
        else:
            self.index.release(write.reserved)
            if msg.error == "busy":
                c.writes_dropped += 1
            else:
                c.write_errors += 1
        write.done.set()

    async def persist(self, entries: list[Entry], held: Callable[[Entry], bool], timeout_s: float) -> Persisted:
        """Write `entries` (those still `held` in memory and worth it, one at a time: the write
        queue is never the limit), wait for every write under way, and persist last-use times;
        all within `timeout_s`."""
        tic = time.perf_counter()
        before = (self._counters.writes, self._counters.written_bytes,
                  self._counters.writes_dropped + self._counters.write_errors)
        with anyio.move_on_after(timeout_s):
            for entry in entries:
                if not held(entry) or not self.worth_writing(entry):
                    continue
                if (done := await self.save(entry, free_after=False)) is not None:
                    await done.wait()
            while self._writing:
                await next(iter(self._writing.values())).done.wait()
            await self._persist_last_use()
        c = self._counters
        return Persisted(True, written=c.writes - before[0], bytes=c.written_bytes - before[1],
                         failed=c.writes_dropped + c.write_errors - before[2], pending=len(self._writing),
                         seconds=round(time.perf_counter() - tic, 3))

    async def _persist_last_use(self) -> None:
        times = [(e.name, e.last_used) for k in self._used if (e := self.index.get(k)) is not None]
        self._used.clear()
        if times:
            await anyio.to_thread.run_sync(touch_files, self.directory, times)

    def _delete(self, names: list[str]) -> None:
        if names:
            directory = self.directory
            self.spawn(lambda: anyio.to_thread.run_sync(remove_files, directory, names))

    def stats(self) -> DiskStats:
        s = self.index.stats()
        c = self._counters
        return DiskStats(directory=str(self.directory), entries=s.entries, bytes=s.bytes, budget_bytes=s.budget_bytes,
                         reserved_bytes=s.reserved_bytes, pinned=s.pinned, found_at_start=c.found_at_start,
                         hits=c.hits, hit_tokens=c.hit_tokens, loads=c.loads, load_seconds=round(c.load_seconds, 4),
                         rejected=dict(c.rejected), load_errors=c.load_errors, writes=c.writes,
                         written_bytes=c.written_bytes, copy_seconds=round(c.copy_seconds, 4),
                         write_seconds=round(c.write_seconds, 4), writes_dropped=c.writes_dropped,
                         write_errors=c.write_errors,
                         writes_skipped=c.writes_skipped, pending_writes=len(self._writing), evictions=s.evictions,
                         evicted_bytes=s.evicted_bytes, temporaries_removed=c.temporaries_removed,
                         preloaded=PreloadStats(c.preload, c.preloaded, c.preloaded_bytes,  # type: ignore[arg-type]
                                                round(c.preload_seconds, 4), c.preload_left))

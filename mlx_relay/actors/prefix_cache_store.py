"""PrefixCacheStore: the actor that decides what prompt state is reused and what is kept.

It owns the prefix index (`cache.prefix_index.PrefixIndex`: chain-hashed keys, media spans keyed
by content hash, a byte budget with LRU eviction over unpinned entries). It never touches an
array: the snapshots themselves live on the GPU executor's thread behind integer handles.

    ChatService --Lookup--> store: match (pinned) + what to snapshot  --> PrefixPlan
    GPUExecutor --SnapshotTaken--> store: a snapshot now exists (system-prompt end, or a finished turn)
    store --FreeSnapshots--> GPUExecutor: handles evicted, rejected or flushed
    ChatService --Release--> store: the request is over (unpin, forget its keys)

Its byte budget is the GPUExecutor's (`ModelInfo.prefix_cache_bytes`: a share of the device's
memory unless configured).

Snapshot boundaries are the ones agents reuse (the Normalizer's `Boundaries`): the end of the
(normalized) system prompt and of each of the client's system texts before its last (an agent's
instructions before its session's environment: a new session restores them), the end of the prompt's
last image or video (asked about again with another question), and the end of each turn as the next
request will repeat it, for each of the two ways a conversation goes on (the Normalizer renders
both): a next user turn (`reply_start`), and, with tools declared, the agent's next tool round
(`round_start`). Where the next request repeats the whole prompt, the prompt's end is snapshotted,
and so is the whole state after the reply (prompt + reply, taken when the request ends), which the
next request restores when the template renders the reply exactly as it was generated; else the
state up to where it stops repeating (Qwen templates drop a past reply's `<think>` block once a new
user query follows, so a next user turn repeats up to the reply's header; inside a tool loop
Qwen3.5's and Qwen3's keep it, so each tool round repeats the previous request's whole prompt).

Snapshots a conversation moves past are freed first, as a radix cache reuses a growing path:
once a request's own turn snapshot is in, the turn snapshots its prompt has gone past (earlier
rounds of a tool loop, a whole turn that came back otherwise, an earlier user turn's) are taken
out (`PrefixIndex.moved_past` / `supersede`, counted as `superseded`), keeping, for each way
the conversation can go on, the longest snapshot it would restore; so a 100-round tool loop
holds the last round's snapshots, not a hundred.

The store owns the policy of what is worth keeping. A turn snapshot pays only if the
conversation comes back, so it is taken only where a next turn is likely: the conversation is
already multi-turn (an earlier assistant or tool message), or the request declares tools (an
agent; a reply ending in tool calls implies declared tools, since undeclared ones are never
parsed, so the Lookup-time signal covers it and the engine need not report how a reply ended).
A one-shot chat gets none (counted in `turns_skipped`). Under pressure the index evicts turn
snapshots that were never hit first. Stats are kept per snapshot kind (`by_kind`).

With a snapshot directory (`--prefix-cache-dir`) the store also runs the disk tier
(`prefix_disk_tier.DiskTier`): snapshots worth keeping are written to disk, evicted ones are
spilled there rather than lost, and a lookup whose longest match is on disk is answered off the
mailbox (a job: `Lookup` through `request`) once the GPUExecutor has loaded it, then exactly as
a memory hit. `PersistPrefixCache` is the drain's hook: write what is only in memory, wait for
the writes under way.

    ChatService --Lookup (request)--> store [--LoadSnapshot--> GPUExecutor --SnapshotLoaded-->] PrefixPlan
    store --SaveSnapshot--> GPUExecutor --SnapshotSaved--> store
    drain --PersistPrefixCache (request)--> store --> Persisted
    relay --PreloadPrefixCache--> store [--LoadSnapshot--> GPUExecutor --SnapshotLoaded-->]* (once ready)

Once the server is ready the store preloads the disk tier into the memory tier (`preload`: a
share of the memory budget), so a restarted server's warm sessions are memory hits; lookups are
never held up by it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import anyio
import msgspec

from mlx_relay.actors.prefix_disk_tier import DiskTier, DiskTierConfig
from mlx_relay.cache.prefix_index import Entry, Inserted, PrefixIndex, SnapshotKind
from mlx_relay.cache.prefix_keys import MediaSpan, PrefixKeys
from mlx_relay.messages.prefix_cache import (
    Flush,
    Flushed,
    FreeSnapshots,
    GetPrefixStats,
    Lookup,
    Persisted,
    PersistPrefixCache,
    PrefixPlan,
    PrefixStats,
    PreloadPrefixCache,
    Release,
    SnapshotLoaded,
    SnapshotSaved,
    SnapshotTaken,
)
from mlx_relay.runtime import Actor, ActorRef, Rejection, ReplyStream

#: Snapshot kinds written to disk as soon as they are taken (shared by every conversation that
#: starts with them); turns are written when the memory tier evicts them, or by a drain.
WRITE_THROUGH: frozenset[str] = frozenset({"system", "media"})


class NeedsRequest(Rejection):
    """A message answered off the mailbox was sent with `ask` (it needs `request`)."""


class PrefixCacheConfig(msgspec.Struct, frozen=True):
    budget_bytes: int  # the GPUExecutor's (`ModelInfo.prefix_cache_bytes`)
    min_snapshot_tokens: int = 256  # a shorter system prompt is not worth a snapshot
    snapshot_turns: bool = True
    disk: DiskTierConfig | None = None  # the disk tier (None: off)
    # once the server is ready, the disk tier's files are loaded into memory (most recently used
    # first) until the next would take the memory tier past this share of `budget_bytes` (0: off)
    preload: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.preload <= 1.0:
            raise ValueError("PrefixCacheConfig.preload must be in [0, 1]")


class _Pending(msgspec.Struct):
    tokens: list[int]
    media: list[MediaSpan]
    keys: PrefixKeys
    pinned: int | None
    planned: dict[int, SnapshotKind] = {}  # snapshot length -> why it was asked for
    # where the conversation's next requests stop repeating this prompt (its next user turn, its
    # next tool round; at most its length): what its turn snapshots keep (none: no next turn likely)
    points: list[int] = []


Message = (Lookup | SnapshotTaken | Release | Flush | GetPrefixStats | SnapshotSaved | SnapshotLoaded
           | PersistPrefixCache | PreloadPrefixCache)


class PrefixCacheStore(Actor):
    accepts = (Lookup, SnapshotTaken, Release, Flush, GetPrefixStats, SnapshotSaved, SnapshotLoaded,
               PersistPrefixCache, PreloadPrefixCache)
    mailbox_capacity = 4096

    def __init__(self, config: PrefixCacheConfig, gpu: ActorRef) -> None:
        self.config = config
        self.gpu = gpu
        self.index = PrefixIndex(config.budget_bytes)
        self.disk = DiskTier(config.disk, gpu, self.start_task) if config.disk is not None else None
        self._pending: dict[str, _Pending] = {}
        self._inserts = self._rejected = self._turns_skipped = 0
        self._preload = self.disk is not None and config.preload > 0  # until it has started

    async def on_start(self) -> None:
        if self.disk is not None:
            await self.disk.start()
            if self._preload:
                self.disk.preload_planned()

    async def receive(self, msg: Message, stream: ReplyStream | None) -> object:
        match msg:
            case Lookup():
                return await self._lookup_or_load(msg, stream)
            case SnapshotTaken():
                await self._after_insert(self._insert(msg), msg)
                return None
            case Release():
                pending = self._pending.pop(msg.request_id, None)
                if pending is not None and pending.pinned is not None:
                    await self._release(pending.pinned)
                return None
            case Flush():
                evicted = self.index.flush()
                await self._evict(evicted.entries, release_memory=True)
                return Flushed(len(evicted.entries), evicted.nbytes)
            case GetPrefixStats():
                return self._stats()
            case SnapshotSaved():
                if self.disk is not None:
                    self.disk.saved(msg)
                return None
            case SnapshotLoaded():
                await self._loaded(msg)
                return None
            case PreloadPrefixCache():
                if self._preload and self.disk is not None:
                    self._preload = False
                    self.start_task(self._preload_disk)
                return None
            case PersistPrefixCache(timeout_s=timeout):
                disk = self.disk
                if disk is None:
                    return _reply(stream, Persisted(False))
                # system and media snapshots first, then turns, most recently used first
                entries = sorted(reversed(self.index.entries()), key=lambda e: e.kind not in WRITE_THROUGH)
                return self._answer_later(stream, lambda: disk.persist(
                    entries, lambda e: self.index.entry(e.handle) is not None, timeout))
        raise TypeError(type(msg).__name__)

    async def on_stop(self) -> None:
        self._pending.clear()

    def _answer_later(self, stream: ReplyStream | None, job: Callable[[], Awaitable[msgspec.Struct]]) -> None:
        if stream is None:  # it waits for replies this mailbox must go on handling
            raise NeedsRequest("send PersistPrefixCache with `request`, not `ask`")
        self.start_job(stream, job)

    # -- decisions ------------------------------------------------------------------------------
    async def _lookup_or_load(self, msg: Lookup, stream: ReplyStream | None) -> PrefixPlan | None:
        """The plan at once, or (the longest match is on disk, longer than memory's) after the
        GPUExecutor has loaded it, off the mailbox. `ask` always gets the plan at once."""
        old = self._pending.pop(msg.request_id, None)
        if old is not None and old.pinned is not None:  # a reused id: its earlier pin goes
            await self._release(old.pinned)
        keys = PrefixKeys(msg.tokens, msg.media)
        disk = self.disk
        if disk is not None and stream is not None:
            peek = self.index.peek(keys)
            candidate = disk.candidate(keys, peek.length if peek is not None else 0)
            if candidate is not None:
                done = await disk.load(candidate)

                async def after_load() -> PrefixPlan:
                    with anyio.move_on_after(disk.config.load_timeout_s):
                        await done.wait()
                    plan = self._lookup(msg, keys)
                    if plan.restore_length == candidate.length:
                        disk.hit(candidate.length)
                    return plan

                self.start_job(stream, after_load)
                return None
        return _reply(stream, self._lookup(msg, keys))

    def _lookup(self, msg: Lookup, keys: PrefixKeys) -> PrefixPlan:
        match = self.index.match(keys)
        entry = match.entry
        if entry is not None and self.disk is not None:
            self.disk.used(entry.key)
        pending = _Pending(msg.tokens, msg.media, keys, entry.handle if entry else None)
        self._pending[msg.request_id] = pending
        done, n = (entry.length if entry is not None else 0), len(msg.tokens)
        # where the next requests stop repeating this prompt: its next user turn (the reply's
        # header, for templates that render past replies differently from the generation
        # prompt), its next tool round (with tools declared); at most the prompt's end, and the
        # whole turn (prompt + reply) where one repeats the whole prompt
        b = msg.boundaries
        reach = [b.reply_start, *([b.round_start] if msg.has_tools and b.round_start else [])]
        points = sorted({min(p, n) for p in reach if p > 0}) if self.config.snapshot_turns else []
        whole_turn = bool(points) and max(reach) >= n
        # those (a turn snapshot only where a next turn is likely), the system prompt's end, and
        # the end of the prompt's last media item (the same image asked about again: everything
        # up to it is reused, the vision tower is skipped)
        candidates: dict[int, SnapshotKind] = dict.fromkeys(points, "turn")
        candidates[max((m.end for m in msg.media), default=0)] = "media"
        candidates.update(dict.fromkeys(b.system, "system"))
        planned = {s: kind for s, kind in candidates.items()
                   if done < s <= n and s >= self.config.min_snapshot_tokens and not self.index.has(keys, s)}
        if not self._next_turn_likely(msg):
            if whole_turn or "turn" in planned.values():
                self._turns_skipped += 1
            whole_turn, points = False, []
            planned = {s: kind for s, kind in planned.items() if kind != "turn"}
        pending.planned, pending.points = planned, points
        return PrefixPlan(restore=entry.handle if entry else None, restore_length=done, snapshot_at=sorted(planned),
                          snapshot_turn=whole_turn)

    @staticmethod
    def _next_turn_likely(msg: Lookup) -> bool:
        """Whether the conversation is likely to come back with this turn as its prefix."""
        return msg.multi_turn or msg.has_tools

    def _insert(self, snap: SnapshotTaken) -> Sequence[Entry | int]:
        pending = self._pending.get(snap.request_id)
        if pending is None:  # the request is already over (cancelled): nothing can key it
            self._rejected += 1
            return [snap.handle]
        keys = pending.keys
        if snap.generated:
            keys = PrefixKeys(pending.tokens + snap.generated, pending.media)
        if snap.length > len(keys):
            self._rejected += 1
            return [snap.handle]
        kind = snap.kind if snap.generated else pending.planned.get(snap.length, snap.kind)
        gone: list[Entry] = []
        if kind == "turn" and snap.nbytes <= self.index.budget_bytes:
            # what this conversation has moved past goes first, before anything is evicted for it
            moved = self.index.moved_past(pending.keys, len(pending.tokens), pending.points,
                                          incoming=None if snap.generated else snap.length)
            gone = self.index.supersede(moved)
            self._forget(gone)
        result = self.index.insert(keys, snap.length, snap.handle, snap.nbytes, kind,
                                   origin_length=len(pending.tokens))
        if isinstance(result, Inserted):
            self._inserts += 1
            return [result.entry, *result.evicted, *(e.handle for e in gone)]
        self._rejected += 1
        return [*result.evicted, *(e.handle for e in gone), result.handle]

    async def _after_insert(self, items: Sequence[Entry | int], snap: SnapshotTaken) -> None:
        """Free (or spill) what the insert pushed out; write a new system or media snapshot
        through to disk; a turn taken from a restored turn supersedes it."""
        inserted = items[0] if items and isinstance(items[0], Entry) and items[0].handle == snap.handle else None
        rest = items[1:] if inserted is not None else items
        await self._evict([i for i in rest if isinstance(i, Entry)])
        await self._free([i for i in rest if isinstance(i, int)])
        disk = self.disk
        if disk is None or inserted is None:
            return
        pending = self._pending.get(snap.request_id)
        if snap.generated and pending is not None and pending.pinned is not None:
            restored = self.index.entry(pending.pinned)
            if restored is not None and restored.kind == "turn":
                disk.superseded(restored.handle)
        if inserted.kind in WRITE_THROUGH and disk.worth_writing(inserted):
            await disk.save(inserted, free_after=False)

    async def _loaded(self, msg: SnapshotLoaded) -> None:
        """A file the disk tier asked for is loaded (into the memory tier) or failed."""
        disk = self.disk
        if disk is None:
            if msg.handle is not None:
                await self._free([msg.handle])
            return
        entry, done = disk.loaded(msg)
        if msg.handle is not None:
            if entry is None:
                await self._free([msg.handle])
            else:
                result = self.index.insert_key(entry.key, entry.length, msg.handle, msg.nbytes, entry.kind)
                if isinstance(result, Inserted):
                    await self._evict(result.evicted)
                else:  # already there (a prefill took it meanwhile), or no room: not kept
                    await self._evict(result.evicted)
                    await self._free([result.handle])
        if done is not None:
            done.set()

    async def _preload_disk(self) -> None:
        """The disk tier's files into the memory tier, up to the preload cap (a background task:
        lookups go on meanwhile)."""
        assert self.disk is not None
        cap = int(self.config.preload * self.config.budget_bytes)

        def held(key: bytes) -> int | None:
            entry = self.index.get(key)
            return entry.nbytes if entry is not None else None

        # each file loaded is older than those before it: it goes to the LRU's cold end
        await self.disk.preload(lambda e: self.index.nbytes + e.nbytes <= cap, held, self.index.demote)

    async def _evict(self, entries: Sequence[Entry], release_memory: bool = False) -> None:
        """Entries the memory tier let go: spilled to disk where worth it, freed otherwise."""
        free: list[int] = []
        disk = self.disk
        for e in entries:
            if disk is not None and disk.worth_writing(e):
                disk.forget(e.handle)
                await disk.save(e, free_after=True)  # the GPUExecutor frees it once copied out
            else:
                if disk is not None:
                    disk.forget(e.handle)
                free.append(e.handle)
        if free or release_memory:
            await self.gpu.tell(FreeSnapshots(free, release_memory=release_memory))

    async def _free(self, handles: list[int]) -> None:
        if handles:
            await self.gpu.tell(FreeSnapshots(handles))

    async def _release(self, handle: int) -> None:
        """A request is done restoring from `handle`: freed if the conversation moved past it meanwhile."""
        freed = self.index.release(handle)
        if freed is not None:
            self._forget([freed])
            await self._free([freed.handle])

    def _forget(self, entries: Sequence[Entry]) -> None:
        """Entries a conversation moved past leave the memory tier: freed, never spilled to disk."""
        if self.disk is not None:
            for e in entries:
                self.disk.forget(e.handle)

    def _stats(self) -> PrefixStats:
        stats = self.index.stats()
        kinds = stats.by_kind
        return PrefixStats(**msgspec.structs.asdict(stats), enabled=True, inserts=self._inserts,
                           rejected=self._rejected, system_entries=kinds["system"].entries,
                           media_entries=kinds["media"].entries, turn_entries=kinds["turn"].entries,
                           turns_skipped=self._turns_skipped,
                           disk=self.disk.stats() if self.disk is not None else None)


def _reply(stream: ReplyStream | None, item: msgspec.Struct) -> msgspec.Struct | None:
    """A reply to `ask` (returned) or to `request` (sent on its stream)."""
    if stream is None:
        return item
    stream.send(item)
    stream.close()
    return None

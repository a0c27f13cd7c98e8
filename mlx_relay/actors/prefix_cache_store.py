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

Snapshot boundaries are the ones agents reuse: the end of the (normalized) system prompt, the
end of the prompt's last image or video (asked about again with another question), and the end
of each turn as the next turn will repeat it: the whole state (prompt + reply) when the chat
template renders past replies exactly as it prompted them, else the state up to the reply's
header (Qwen templates drop a past reply's `<think>` block, so nothing past that header can be
reused by turn N+1).

The store owns the policy of what is worth keeping. A turn snapshot pays only if the
conversation comes back, so it is taken only where a next turn is likely: the conversation is
already multi-turn (an earlier assistant or tool message), or the request declares tools (an
agent; a reply ending in tool calls implies declared tools, since undeclared ones are never
parsed, so the Lookup-time signal covers it and the engine need not report how a reply ended).
A one-shot chat gets none (counted in `turns_skipped`). Under pressure the index evicts turn
snapshots that were never hit first. Stats are kept per snapshot kind (`by_kind`).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from mlx_relay.cache.prefix_index import Entry, Inserted, PrefixIndex, SnapshotKind
from mlx_relay.cache.prefix_keys import MediaSpan, PrefixKeys
from mlx_relay.messages.prefix_cache import (
    Flush,
    Flushed,
    FreeSnapshots,
    GetPrefixStats,
    Lookup,
    PrefixPlan,
    PrefixStats,
    Release,
    SnapshotTaken,
)
from mlx_relay.runtime import Actor, ActorRef, ReplyStream


class PrefixCacheConfig(msgspec.Struct, frozen=True):
    budget_bytes: int  # the GPUExecutor's (`ModelInfo.prefix_cache_bytes`)
    min_snapshot_tokens: int = 256  # a shorter system prompt is not worth a snapshot
    snapshot_turns: bool = True


class _Pending(msgspec.Struct):
    tokens: list[int]
    media: list[MediaSpan]
    keys: PrefixKeys
    pinned: int | None
    planned: dict[int, SnapshotKind] = {}  # snapshot length -> why it was asked for


class PrefixCacheStore(Actor):
    accepts = (Lookup, SnapshotTaken, Release, Flush, GetPrefixStats)
    mailbox_capacity = 4096

    def __init__(self, config: PrefixCacheConfig, gpu: ActorRef) -> None:
        self.config = config
        self.gpu = gpu
        self.index = PrefixIndex(config.budget_bytes)
        self._pending: dict[str, _Pending] = {}
        self._inserts = self._rejected = self._turns_skipped = 0

    async def receive(self, msg: Lookup | SnapshotTaken | Release | Flush | GetPrefixStats,
                      stream: ReplyStream | None) -> object:
        match msg:
            case Lookup():
                return self._lookup(msg)
            case SnapshotTaken():
                await self._free(self._insert(msg))
                return None
            case Release():
                pending = self._pending.pop(msg.request_id, None)
                if pending is not None and pending.pinned is not None:
                    self.index.release(pending.pinned)
                return None
            case Flush():
                evicted = self.index.flush()
                handles = [e.handle for e in evicted.entries]
                await self.gpu.tell(FreeSnapshots(handles, release_memory=True))
                return Flushed(len(evicted.entries), evicted.nbytes)
            case GetPrefixStats():
                return self._stats()
        raise TypeError(type(msg).__name__)

    async def on_stop(self) -> None:
        self._pending.clear()

    # -- decisions ------------------------------------------------------------------------------
    def _lookup(self, msg: Lookup) -> PrefixPlan:
        keys = PrefixKeys(msg.tokens, msg.media)
        match = self.index.match(keys)
        entry = match.entry
        old = self._pending.pop(msg.request_id, None)
        if old is not None and old.pinned is not None:  # a reused id: its earlier pin goes
            self.index.release(old.pinned)
        pending = _Pending(msg.tokens, msg.media, keys, entry.handle if entry else None)
        self._pending[msg.request_id] = pending
        done = entry.length if entry is not None else 0
        # the system prompt's end, and the end of the prompt's last media item (the same image
        # asked about again: everything up to it is reused, the vision tower is skipped)
        # and where the next turn's prompt stops repeating this one (the reply's header, for
        # templates that render past replies differently from the generation prompt)
        # (a turn snapshot only where a next turn is likely)
        whole_turn = self.config.snapshot_turns and msg.reply_start >= len(msg.tokens)
        candidates: dict[int, SnapshotKind] = {}
        if self.config.snapshot_turns and not whole_turn:
            candidates[msg.reply_start] = "turn"
        candidates[max((m.end for m in msg.media), default=0)] = "media"
        candidates[msg.system_end] = "system"
        planned = {s: kind for s, kind in candidates.items()
                   if done < s < len(msg.tokens) and s >= self.config.min_snapshot_tokens
                   and not self.index.has(keys, s)}
        if not self._next_turn_likely(msg):
            if whole_turn or "turn" in planned.values():
                self._turns_skipped += 1
            whole_turn = False
            planned = {s: kind for s, kind in planned.items() if kind != "turn"}
        pending.planned = planned
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
        result = self.index.insert(keys, snap.length, snap.handle, snap.nbytes, kind)
        if isinstance(result, Inserted):
            self._inserts += 1
            return result.evicted
        self._rejected += 1
        return [*result.evicted, result.handle]

    async def _free(self, items: Sequence[Entry | int]) -> None:
        handles = [i if isinstance(i, int) else i.handle for i in items]
        if handles:
            await self.gpu.tell(FreeSnapshots(handles))

    def _stats(self) -> PrefixStats:
        stats = self.index.stats()
        kinds = stats.by_kind
        return PrefixStats(**msgspec.structs.asdict(stats), enabled=True, inserts=self._inserts,
                           rejected=self._rejected, system_entries=kinds["system"].entries,
                           media_entries=kinds["media"].entries, turn_entries=kinds["turn"].entries,
                           turns_skipped=self._turns_skipped)

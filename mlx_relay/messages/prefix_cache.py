"""Messages of the PrefixCacheStore (`actors/prefix_cache_store.py`) and the snapshots it keys:
the requester looks up a plan, the GPUExecutor reports the snapshots it took, the store tells the
GPUExecutor which to free."""

from __future__ import annotations

from typing import Literal

import msgspec

from mlx_relay.cache.prefix_index import IndexStats
from mlx_relay.cache.prefix_keys import MediaSpan


class PrefixPlan(msgspec.Struct, frozen=True):
    """What the PrefixCacheStore decided for one request (the handles are the GPU executor's)."""

    restore: int | None = None  # snapshot handle to start from (pinned by the store meanwhile)
    restore_length: int = 0  # prompt tokens that snapshot covers
    snapshot_at: list[int] = []  # prompt lengths to snapshot during prefill (e.g. the system prompt's end)
    snapshot_turn: bool = False  # snapshot the whole state when the request finishes normally


class Lookup(msgspec.Struct, frozen=True):
    """Ask: the plan for a prompt. Reply: PrefixPlan (its restore entry pinned until Release)."""

    request_id: str
    tokens: list[int]
    media: list[MediaSpan] = []
    system_end: int = 0  # where the normalized system prompt ends in `tokens` (0: none)
    reply_start: int = 0  # how much of `tokens` the conversation's next turn will repeat
    multi_turn: bool = False  # the conversation already has an assistant (or tool) message
    has_tools: bool = False  # the request declares tools (an agent)


class SnapshotTaken(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> store): a snapshot of `request_id`'s state now exists on the GPU
    thread. `generated`: the completion tokens it covers beyond the prompt."""

    request_id: str
    handle: int
    length: int
    nbytes: int
    kind: Literal["system", "turn"]
    generated: list[int] = []


class FreeSnapshots(msgspec.Struct, frozen=True):
    """Tell (store -> GPUExecutor): drop these snapshots (evicted or rejected). `release_memory`
    (a flush): also hand MLX's cache of freed buffers back (otherwise kept for reuse)."""

    handles: list[int]
    release_memory: bool = False


class Release(msgspec.Struct, frozen=True):
    """Tell: the request is over."""

    request_id: str


class Flush(msgspec.Struct, frozen=True):
    """Ask: drop every unpinned snapshot. Reply: Flushed."""


class Flushed(msgspec.Struct, frozen=True):
    entries: int
    bytes: int


class GetPrefixStats(msgspec.Struct, frozen=True):
    """Ask. Reply: PrefixStats."""


class PrefixStats(IndexStats, frozen=True):
    """The index's counters (`by_kind`: per snapshot kind), and what the store itself counts."""

    enabled: bool
    inserts: int
    rejected: int
    system_entries: int
    media_entries: int
    turn_entries: int
    turns_skipped: int  # turn snapshots not taken: a one-shot chat, no next turn likely

"""Messages of the PrefixCacheStore (`actors/prefix_cache_store.py`) and the snapshots it keys:
the requester looks up a plan, the GPUExecutor reports the snapshots it took, the store tells the
GPUExecutor which to free. With the disk tier on, the store also tells the GPUExecutor which
snapshots to write to disk (`SaveSnapshot` -> `SnapshotSaved`) and which file to load into a new
snapshot handle (`LoadSnapshot` -> `SnapshotLoaded`); a drain asks it to `PersistPrefixCache`."""

from __future__ import annotations

from typing import Literal

import msgspec

from mlx_relay.cache.prefix_index import IndexStats
from mlx_relay.cache.prefix_keys import MediaSpan
from mlx_relay.cache.snapshot_files import RejectReason, SnapshotIdentity
from mlx_relay.messages.prompt import Boundaries


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
    boundaries: Boundaries = Boundaries()  # where the next requests stop repeating `tokens`
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


class SaveSnapshot(msgspec.Struct, frozen=True):
    """Tell (store -> GPUExecutor): write snapshot `handle` to a file in `directory`, `metadata`
    in its header. `free_after`: the store no longer keeps it in memory (evicted): free it once
    copied out. `nbytes` (what it holds) counts against the GPUExecutor's write-queue bound; past
    the bound the write is dropped. Answered with SnapshotSaved."""

    key: bytes
    handle: int
    nbytes: int
    directory: str
    metadata: dict[str, str]
    free_after: bool = False


class SnapshotSaved(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> store): the file of `key` is on disk (`name`, `nbytes`), or `error`:
    "busy" (dropped: the write queue was full), "gone" (the handle was already freed), "io"."""

    key: bytes
    name: str = ""
    nbytes: int = 0
    error: Literal["busy", "gone", "io"] | None = None
    detail: str = ""
    copy_seconds: float = 0.0  # the host copy, on the GPU thread (between steps)
    write_seconds: float = 0.0  # waiting for the writer thread and writing (off the GPU thread)


class LoadSnapshot(msgspec.Struct, frozen=True):
    """Tell (store -> GPUExecutor): read the file at `path` off the GPU thread, check it (size,
    checksum, `identity`, `length`, then every tensor against the live model's cache layout) and
    make it a snapshot handle. Answered with SnapshotLoaded."""

    key: bytes
    path: str
    length: int
    identity: SnapshotIdentity


class SnapshotLoaded(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> store): `handle` now holds the file's snapshot (`nbytes` held), or
    `error` says why the file cannot be used ("io": it could not be read, the file is kept)."""

    key: bytes
    handle: int | None = None
    nbytes: int = 0
    error: RejectReason | Literal["io"] | None = None
    detail: str = ""
    seconds: float = 0.0  # read, check and load


class PersistPrefixCache(msgspec.Struct, frozen=True):
    """Request (a drain, an operator): write every snapshot held in memory that is worth keeping
    and not on disk yet, then wait for the writes under way, all within `timeout_s`. Reply:
    Persisted. Without the disk tier: Persisted(enabled=False)."""

    timeout_s: float = 30.0


class Persisted(msgspec.Struct, frozen=True):
    enabled: bool
    written: int = 0  # files written while it ran
    bytes: int = 0
    failed: int = 0  # writes that did not land (dropped, errors)
    pending: int = 0  # writes still under way at the deadline
    seconds: float = 0.0


class PreloadPrefixCache(msgspec.Struct, frozen=True):
    """Tell (the relay, once the server is ready): load the disk tier's files into the memory
    tier, most recently used first, one at a time, up to `PrefixCacheConfig.preload` of the
    memory budget. Ignored without a disk tier, with preloading off, or after the first."""


class GetPrefixStats(msgspec.Struct, frozen=True):
    """Ask. Reply: PrefixStats."""


class PreloadStats(msgspec.Struct, frozen=True):
    """The start-up preload of the disk tier into the memory tier (`DiskStats.preloaded`)."""

    state: Literal["off", "waiting", "running", "done"]  # waiting: for the server to be ready
    entries: int = 0  # files loaded into the memory tier by the preload
    bytes: int = 0  # what they hold in memory
    seconds: float = 0.0  # the preload's wall time, start to end
    left_on_disk: int = 0  # files not preloaded: the next one would have passed the cap


class DiskStats(msgspec.Struct, frozen=True):
    """The disk tier's counters (`PrefixStats.disk`)."""

    directory: str
    entries: int
    bytes: int
    budget_bytes: int
    reserved_bytes: int  # writes under way
    pinned: int  # files being loaded
    found_at_start: int  # usable files the start-up scan found
    hits: int  # lookups restored from a snapshot loaded from disk
    hit_tokens: int
    loads: int
    load_seconds: float  # read + check + load, summed
    rejected: dict[str, int]  # files never loaded into a request, by reason (removed): corrupt,
    # truncated, mismatch (another model, dtype, library version or format), missing, layout
    load_errors: int  # files that could not be read (kept)
    writes: int
    written_bytes: int
    copy_seconds: float  # host copies for the writes, on the GPU thread (between steps), summed
    write_seconds: float  # the writes themselves, off the GPU thread, summed
    writes_dropped: int  # the write queue was full (the disk slower than snapshots come)
    write_errors: int
    writes_skipped: int  # larger than the budget left by pinned files, or superseded turns
    pending_writes: int
    evictions: int  # files deleted to stay within the budget
    evicted_bytes: int
    temporaries_removed: int  # half-written files of an earlier run
    preloaded: PreloadStats = PreloadStats("off")


class PrefixStats(IndexStats, frozen=True):
    """The index's counters (`by_kind`: per snapshot kind), and what the store itself counts."""

    enabled: bool
    inserts: int
    rejected: int
    system_entries: int
    media_entries: int
    turn_entries: int
    turns_skipped: int  # turn snapshots not taken: a one-shot chat, no next turn likely
    disk: DiskStats | None = None  # the disk tier (None: off)

"""The prefix cache's disk tier (`--prefix-cache-dir`), on the float32 tiny VLM.

A server writes its system-prompt snapshots through to disk, and its agent turn when asked to
persist (the drain's hook); a NEW server on the same directory restores them instead of
prefilling and returns exactly what the cold prefill returned. Files that must not be used (a
flipped byte, a cut-off file, another model, dtype or library version in the header, tensors of
the wrong dtype under a right header) are each detected, counted, removed and never restored: the
request still returns the cold prefill's tokens. The disk budget deletes the least recently used
files. The store's policy: system snapshots are written through, evictions spill, a turn the
conversation has moved past is not written.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import xxhash
from safetensors.numpy import load_file, save_file

from mlx_relay.actors.prefix_cache_store import PrefixCacheConfig, PrefixCacheStore
from mlx_relay.actors.prefix_disk_tier import DiskTier, DiskTierConfig
from mlx_relay.cache.disk_index import DiskEntry, DiskIndex
from mlx_relay.cache.prefix_keys import PrefixKeys
from mlx_relay.cache.snapshot_files import SnapshotIdentity, file_name, scan
from mlx_relay.chat.reply import ChatReply
from mlx_relay.messages.prefix_cache import (
    Flush,
    FreeSnapshots,
    GetPrefixStats,
    LoadSnapshot,
    Lookup,
    PrefixPlan,
    PrefixStats,
    Release,
    SaveSnapshot,
    SnapshotLoaded,
    SnapshotSaved,
    SnapshotTaken,
)
from mlx_relay.messages.prompt import Boundaries
from mlx_relay.relay import Relay

SYSTEM = ("You are a careful coding agent. Follow the repository's conventions, keep changes small, "
          "run the tests before you answer, and explain what you changed and why. ") * 3
OPTS: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
CACHE: dict[str, Any] = {"prefix_min_snapshot_tokens": 8, "max_num_seqs": 8, "mtp_policy": "always",
                         "warmup": False}
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object", "properties": {}}}}]
SESSIONS = 7  # 0 intact, 1 flipped byte, 2 cut off, 3 other model, 4 other dtype, 5 other mlx, 6 wrong tensors
# an agent's first turn leaves three: its reply's header (what a next user turn restores), its
# prompt's end and its whole turn (what a next tool round restores)
TURN_FILES = 3



async def settled_disk_stats(relay: Relay) -> dict[str, Any]:
    """The disk tier's stats once no write is under way (writes go through off the requests)."""
    with anyio.fail_after(30):
        while (disk := (await relay.prefix_cache_stats())["prefix_cache"]["disk"])["pending_writes"]:
            await anyio.sleep(0.02)
    return disk

def conv(i: int, question: str = "Fix the failing test in utils.py") -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"Session {i}. {SYSTEM}"}, {"role": "user", "content": question}]


def agent(turns: list[tuple[str, str]], question: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for user, reply in turns:
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return [*msgs, {"role": "user", "content": question}]


class Written(msgspec.Struct):
    directory: Path  # the model's snapshot directory
    files: list[str]  # session i's system snapshot
    turn_file: str  # the turn's reply header: what turn 2 restores
    cold: list[ChatReply]
    agent1: ChatReply
    agent2: ChatReply  # turn 2, restored from turn 1's snapshot in memory
    persisted_written: int
    writes_before_persist: int


@pytest.fixture(scope="module")
async def written(fp32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Written]:
    """Server A: a cold request per session (each system snapshot written through), an agent's
    first turn (its turn snapshots only in memory until persisted), then turn 2."""
    root = tmp_path_factory.mktemp("prefix-disk")
    async with Relay.start(fp32_model, prefix_cache_dir=str(root), **CACHE) as relay:
        directory = Path((await relay.prefix_cache_stats())["prefix_cache"]["disk"]["directory"])
        cold, files = [], []
        for i in range(SESSIONS):
            cold.append(await relay.chat(conv(i), **OPTS))
            assert (await relay.persist_prefix_cache()).pending == 0  # the write-through has landed
            new = sorted(set(os.listdir(directory)) - set(files))
            assert len(new) == 1, new
            files += new
        agent1 = await relay.chat(agent([], "Run the tests"), tools=TOOLS, **OPTS)
        writes = (await relay.prefix_cache_stats())["prefix_cache"]["disk"]["writes"]
        persisted = await relay.persist_prefix_cache()
        # the agent's system prompt is written through and its turn by the persist; the write-through
        # may land before or during the persist (a loaded machine), so the files are told by kind
        new = sorted(set(os.listdir(directory)) - set(files))
        headers = {name: _header(directory / name) for name in new}
        assert sorted(h["relay.kind"] for h in headers.values()) == ["system", *["turn"] * TURN_FILES], headers
        turn_file = min((int(h["relay.length"]), name) for name, h in headers.items() if h["relay.kind"] == "turn")[1]
        agent2 = await relay.chat(agent([("Run the tests", agent1.raw_text)], "Now fix it"), tools=TOOLS, **OPTS)
    yield Written(directory, files, turn_file, cold, agent1, agent2, persisted.written, writes)


def _header(path: Path) -> dict[str, str]:
    """A snapshot file's safetensors metadata."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    meta: dict[str, str] = json.loads(raw[8:8 + n])["__metadata__"]
    return meta


def _rewrite(path: Path, meta: dict[str, str] | None = None, dtype: Any = None) -> None:
    """Replace a snapshot file by a well-formed one (valid checksum and name) with other header
    metadata or other tensor dtypes."""
    header = _header(path)
    tensors = load_file(path)
    if dtype is not None:
        tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    tmp = path.with_suffix(".rewrite")
    save_file(tensors, tmp, {**header, **(meta or {})})
    data = tmp.read_bytes()
    tmp.unlink()
    path.unlink()
    (path.parent / file_name(bytes.fromhex(header["relay.key"]), xxhash.xxh3_128_hexdigest(data))).write_bytes(data)


async def test_a_new_server_restores_from_disk_and_bad_files_are_counted_never_used(
        written: Written, fp32_model: Path, tmp_path: Path) -> None:
    # every system snapshot written through (the agent's may still be in flight when the persist
    # starts, which then waits for it), and the agent's turn written by the drain's hook
    assert written.writes_before_persist in (SESSIONS, SESSIONS + 1)
    assert written.writes_before_persist + written.persisted_written == SESSIONS + 1 + TURN_FILES
    root = tmp_path / "root"
    shutil.copytree(written.directory.parent, root)
    d = root / written.directory.name
    files = [d / f for f in written.files]
    data = bytearray(files[1].read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the tensors
    files[1].write_bytes(bytes(data))
    os.truncate(files[2], files[2].stat().st_size // 2)
    _rewrite(files[3], {"relay.model": "0" * 32})
    _rewrite(files[4], {"relay.dtype": "bfloat16"})
    _rewrite(files[5], {"relay.mlx": "0.0.1"})
    _rewrite(files[6], dtype=np.float16)  # a right header over tensors the model's caches do not take
    # no preload: each file is loaded (and checked) by its first lookup
    async with Relay.start(fp32_model, prefix_cache_dir=str(root), prefix_cache_preload=0, **CACHE) as relay:
        after = [await relay.chat(conv(i), **OPTS) for i in range(SESSIONS)]
        turn2 = await relay.chat(agent([("Run the tests", written.agent1.raw_text)], "Now fix it"), tools=TOOLS,
                                 **OPTS)
        disk = await settled_disk_stats(relay)  # the write-through of the last turn may still be under way
    # restored from disk or prefilled anew: exactly the cold prefill's tokens
    assert [r.token_ids for r in after] == [r.token_ids for r in written.cold]
    assert after[0].cached_tokens > 0 and all(r.cached_tokens == 0 for r in after[1:])
    assert turn2.token_ids == written.agent2.token_ids
    assert turn2.cached_tokens == written.agent2.cached_tokens > after[0].cached_tokens
    # the intact file, the flipped byte, the wrong tensors, the agent's system prompt and turn pass the scan
    assert disk["found_at_start"] == 4 + TURN_FILES
    assert disk["preloaded"] == {"state": "off", "entries": 0, "bytes": 0, "seconds": 0.0, "left_on_disk": 0}
    assert disk["rejected"] == {"corrupt": 1, "truncated": 1, "mismatch": 3, "missing": 0, "layout": 1}
    assert (disk["hits"], disk["loads"], disk["hit_tokens"]) == (2, 2, after[0].cached_tokens + turn2.cached_tokens)
    # the bad files are gone; their sessions' snapshots were taken and written anew
    left = set(os.listdir(d))
    assert not left & {f.name for f in files[1:]}
    assert disk["entries"] == len(left) == SESSIONS + 1 + TURN_FILES and disk["writes"] == SESSIONS - 1


async def _preload_done(relay: Relay) -> dict[str, Any]:
    with anyio.fail_after(60):
        while (stats := await relay.prefix_cache_stats())["prefix_cache"]["disk"]["preloaded"]["state"] != "done":
            await anyio.sleep(0.05)
    return stats


async def test_a_restarted_server_preloads_its_disk_tier_into_memory_up_to_the_cap(
        written: Written, fp32_model: Path, tmp_path: Path) -> None:
    """Once ready, a new server loads its files into memory, most recently used first, until the
    next would pass the cap: the first request of a preloaded session is a memory hit (no disk
    load on its path); a session past the cap is still restored from disk by its lookup."""
    shutil.copytree(written.directory.parent, tmp_path / "root")
    d = tmp_path / "root" / written.directory.name
    for name in os.listdir(d):
        os.utime(d / name, (500_000, 500_000))
    os.utime(d / written.files[1], (1_000_000, 1_000_000))
    os.utime(d / written.files[0], (2_000_000, 2_000_000))  # the most recently used
    size = (d / written.files[0]).stat().st_size  # each session's, about (the turn's is larger)
    budget = 10 * max((d / name).stat().st_size for name in os.listdir(d))  # room for all
    fraction = 2.5 * size / budget  # two sessions' files and half of another
    async with Relay.start(fp32_model, prefix_cache_dir=str(tmp_path / "root"), prefix_cache_bytes=budget,
                           prefix_cache_preload=fraction, **CACHE) as relay:
        before = await _preload_done(relay)
        first = await relay.chat(conv(0), **OPTS)
        second = await relay.chat(conv(1), **OPTS)
        past_cap = await relay.chat(conv(2), **OPTS)
        after = (await relay.prefix_cache_stats())["prefix_cache"]
    pc, disk = before["prefix_cache"], before["prefix_cache"]["disk"]
    found = len(written.files) + 1 + TURN_FILES  # the sessions, the agent's system prompt and turn
    assert disk["found_at_start"] == found and before["snapshots"]["held"] == pc["entries"] == 2
    preloaded = disk["preloaded"]
    assert (preloaded["entries"], preloaded["bytes"], preloaded["left_on_disk"]) == (2, pc["bytes"], found - 2)
    assert (disk["loads"], disk["hits"], pc["hits"]) == (2, 0, 0)
    # the preloaded sessions: memory hits, no load; past the cap: its own load from disk
    assert [r.token_ids for r in (first, second, past_cap)] == [r.token_ids for r in written.cold[:3]]
    assert first.cached_tokens == second.cached_tokens == past_cap.cached_tokens > 0
    assert (after["hits"], after["disk"]["loads"], after["disk"]["hits"]) == (3, 3, 1)
    assert after["disk"]["preloaded"] == preloaded


async def test_the_disk_budget_keeps_the_most_recently_used_files(written: Written, tmp_path: Path) -> None:
    d = tmp_path / written.directory.name
    shutil.copytree(written.directory, d)
    names = sorted(written.files)
    for name in os.listdir(d):  # the agent's system prompt: longest ago
        os.utime(d / name, (500_000, 500_000))
    for t, name in enumerate(names):  # then the sessions, names[0] longest ago
        os.utime(d / name, (1_000_000 + t, 1_000_000 + t))
    os.utime(d / written.turn_file, (2_000_000, 2_000_000))
    sizes = {name: (d / name).stat().st_size for name in os.listdir(d)}
    identity = _identity_of(d / written.turn_file)
    keep = [written.turn_file, names[-1], names[-2]]
    budget = sum(sizes[n] for n in keep)
    tier = DiskTier(DiskTierConfig(str(tmp_path), budget, identity), _Recorder(), lambda task: None)  # type: ignore[arg-type]
    assert tier.directory == d
    await tier.start()
    assert sorted(os.listdir(d)) == sorted(keep)
    stats = tier.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (3, budget, len(sizes) - 3)
    # a write to come makes room the same way: least recently used first, never a pinned file
    oldest = tier.index.entries()[0]
    tier.index.pin(oldest.key)
    evicted = tier.index.reserve(sizes[names[-1]])
    assert evicted is not None and oldest.key not in {e.key for e in evicted} and len(evicted) == 1


def _identity_of(path: Path) -> SnapshotIdentity:
    raw = path.read_bytes()
    meta = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])["__metadata__"]
    return SnapshotIdentity(meta["relay.model"], meta["relay.dtype"], meta["relay.mlx"], meta["relay.mlx_vlm"])


def test_scan_reads_headers_and_sorts_out_what_cannot_be_used(written: Written, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(written.directory, d)
    identity = _identity_of(d / written.turn_file)
    (d / ".half-written.safetensors.123.abcd.tmp").write_bytes(b"\0" * 10)
    (d / "notes.txt").write_text("not ours: left alone")
    (d / written.files[0]).write_bytes(b"\x01\x00")  # shorter than a header
    result = scan(d, identity)
    # every session, the agent's system prompt and turn, but the cut-off one
    assert len(result.files) == len(written.files) + TURN_FILES and result.temporaries == 1
    assert result.rejected["truncated"] == 1 and "notes.txt" in os.listdir(d)
    other = scan(d, msgspec.structs.replace(identity, mlx_vlm="9.9.9"))
    assert other.files == [] and other.rejected["mismatch"] == len(result.files) and os.listdir(d) == ["notes.txt"]


def test_disk_index_budget_reservations_and_longest_match() -> None:
    keys = PrefixKeys(list(range(300)))
    index = DiskIndex(budget_bytes=1000)
    assert index.load([DiskEntry(keys.key(n), n, "system", f"f{n}", 300, float(n)) for n in (100, 200, 250)]) == []
    assert index.match(keys).length == 250 and index.match(keys, above=250) is None  # type: ignore[union-attr]
    assert index.match(PrefixKeys(list(range(250)))).length == 200  # type: ignore[union-attr]
    index.touch(keys.key(100), 10_000.0)  # used: now the most recent
    index.pin(keys.key(200))
    evicted = index.reserve(400)  # 900 + 400 > 1000: the least recently used unpinned file goes
    assert evicted is not None and [e.length for e in evicted] == [250]
    assert index.reserve(700) is None  # the pinned file and the reservation leave no room
    out = index.add(DiskEntry(keys.key(50), 50, "turn", "f50", 500, 20_000.0), reserved=400)
    assert [e.length for e in out] == [100]  # 500 landed where 400 were reserved: one more goes
    assert index.stats().bytes == 800 and index.stats().reserved_bytes == 0 and len(index) == 2


class _Recorder:
    """Stands in for the GPUExecutor's mailbox: the store's decisions, recorded (policy test)."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def tell(self, msg: object) -> None:
        self.sent.append(msg)


async def test_a_lookup_for_a_file_being_preloaded_waits_for_that_load(written: Written, tmp_path: Path) -> None:
    """The preload loads the most recently used file first; a lookup wanting it meanwhile (the
    store's `DiskTier.load` for its candidate) gets that load's event, not a second load."""
    d = tmp_path / written.directory.name
    shutil.copytree(written.directory, d)
    for name in os.listdir(d):
        os.utime(d / name, (500_000, 500_000))
    os.utime(d / written.turn_file, (3_000_000, 3_000_000))
    gpu = _Recorder()
    tier = DiskTier(DiskTierConfig(str(tmp_path), 1 << 30, _identity_of(d / written.turn_file)), gpu,  # type: ignore[arg-type]
                    lambda task: None)
    await tier.start()
    held: dict[bytes, int] = {}
    async with anyio.create_task_group() as tg:
        landed: list[bytes] = []
        tg.start_soon(tier.preload, lambda e: not held, held.get, landed.append)  # the cap: one file
        with anyio.fail_after(10):
            while not gpu.sent:
                await anyio.sleep(0.01)
        (load,) = gpu.sent
        assert isinstance(load, LoadSnapshot) and load.path.endswith(written.turn_file)
        assert tier.stats().preloaded.state == "running"
        entry = tier.index.get(load.key)
        assert entry is not None
        lookup = await tier.load(entry)
        assert len(gpu.sent) == 1  # no second load
        held[load.key] = 123  # the store inserted it
        loaded, done = tier.loaded(SnapshotLoaded(load.key, handle=1, nbytes=123))
        assert loaded == entry and done is lookup
        done.set()
    preloaded = tier.stats().preloaded
    assert (preloaded.state, preloaded.entries, preloaded.bytes) == ("done", 1, 123)
    assert landed == [load.key]
    assert preloaded.left_on_disk == len(tier.index) - 1 and tier.stats().loads == 1


async def test_store_writes_system_through_spills_evictions_and_skips_superseded_turns(tmp_path: Path) -> None:
    identity = SnapshotIdentity("ab" * 16, "float32", "0.32.4", "0.7.10")
    gpu = _Recorder()
    store = PrefixCacheStore(PrefixCacheConfig(1 << 20, min_snapshot_tokens=8,
                                               disk=DiskTierConfig(str(tmp_path), 1 << 20, identity)), gpu)  # type: ignore[arg-type]
    await store.on_start()
    system = list(range(5, 205))
    first = [*system, *range(300, 320)]
    plan = await store.receive(Lookup("a", first, boundaries=Boundaries([200], len(first)), has_tools=True), None)
    assert isinstance(plan, PrefixPlan) and plan.snapshot_at == [200, len(first)] and plan.snapshot_turn
    await store.receive(SnapshotTaken("a", 1, 200, 100, "system"), None)
    reply = [7, 8, 9]
    await store.receive(SnapshotTaken("a", 2, len(first) + 3, 100, "turn", reply), None)
    saves = [m for m in gpu.sent if isinstance(m, SaveSnapshot)]
    assert [(m.handle, m.free_after) for m in saves] == [(1, False)]  # the system prompt, at once
    assert saves[0].metadata["relay.length"] == "200" and saves[0].metadata["relay.model"] == identity.model
    await store.receive(Release("a"), None)
    second = [*first, *reply, 400, 401]
    plan = await store.receive(Lookup("b", second, boundaries=Boundaries([200], len(second)), has_tools=True), None)
    assert isinstance(plan, PrefixPlan) and plan.restore == 2
    await store.receive(SnapshotTaken("b", 4, len(second), 100, "system"), None)  # its prompt's end
    await store.receive(SnapshotTaken("b", 3, len(second) + 3, 100, "turn", [10, 11, 12]), None)
    await store.receive(Release("b"), None)
    # turn 1 was superseded by turn 2 (the conversation moved past it): freed once "b" no longer
    # restores from it, never written
    freed = [h for m in gpu.sent if isinstance(m, FreeSnapshots) for h in m.handles]
    assert freed == [2] and not [m for m in gpu.sent if isinstance(m, SaveSnapshot) and m.handle == 2]
    await store.receive(SnapshotSaved(saves[0].key, error="busy"), None)  # the disk was slow: dropped
    gpu.sent.clear()
    await store.receive(Flush(), None)
    spilled = [(m.handle, m.free_after) for m in gpu.sent if isinstance(m, SaveSnapshot)]
    # turn 2 is the conversation's latest state (its prompt's end, its whole turn): spilled; the
    # system snapshot (its write dropped) is worth a file again: spilled
    assert sorted(spilled) == [(1, True), (3, True), (4, True)]
    stats = await store.receive(GetPrefixStats(), None)
    assert isinstance(stats, PrefixStats) and stats.disk is not None
    assert (stats.disk.writes_dropped, stats.disk.pending_writes, stats.disk.reserved_bytes) == (1, 3, 300)


async def test_the_drain_writes_the_disk_tier_before_the_flush(fp32_model: Path, tmp_path: Path) -> None:
    """SIGTERM's path (`Relay.drain`): an agent's turn snapshots held only in memory are on disk
    once the drain returns, before the flush drops the memory tier."""
    async with Relay.start(fp32_model, prefix_cache_dir=str(tmp_path), **CACHE) as relay:
        await relay.chat(agent([], "Run the tests"), tools=TOOLS, **OPTS)
        disk = await settled_disk_stats(relay)  # the system prompt's own write (off the request) lands first
        directory = Path(disk["directory"])
        before = set(os.listdir(directory))
        drained = await relay.drain(5.0)
    assert drained.persisted is not None and drained.persisted.written == TURN_FILES
    assert drained.persisted.pending == 0 and drained.flushed is not None
    assert len(set(os.listdir(directory)) - before) == TURN_FILES

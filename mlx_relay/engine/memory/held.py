"""What the engine holds on the device beside its rows, and the memory it reports (GPU thread only).

`EngineCore` keeps one `HeldMemory`: the prefix-cache snapshots (`SnapshotPool`, by handle) and
their file bytes (`snapshot_codec`: encoded for the disk tier's writes, decoded and checked against
the live cache layout on its reads), the image features (`FeatureStore`, by hash), MLX's memory
counters and, on CUDA, the driver's pool (`cuda_memory`), and the idle release: after a burst,
what MLX keeps cached beyond `idle_cache_bytes` goes back to the device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import mlx.core as mx

from mlx_relay.engine.memory.cuda_memory import CudaMemory
from mlx_relay.engine.memory.features import FeatureStore
from mlx_relay.engine.memory.snapshot_codec import CacheLayout, decode, encode
from mlx_relay.engine.memory.snapshots import SnapshotPool
from mlx_relay.memory import release_freed_memory

log = logging.getLogger(__name__)


class HeldMemory:
    def __init__(self, *, cuda: bool, idle_cache_bytes: int, probe_layout: Callable[[], CacheLayout]) -> None:
        self.snapshots = SnapshotPool()
        self.features = FeatureStore()
        self._probe = probe_layout
        self._layout: CacheLayout | None = None  # the caches' layout (the disk tier's check), probed once
        self._cuda = CudaMemory.open() if cuda else None  # the driver's pool, beside MLX
        self._idle_cache_bytes = idle_cache_bytes  # what MLX may keep cached while idle

    def free_snapshots(self, handles: list[int], release_memory: bool = False) -> int:
        """Drop snapshots; `release_memory` (a flush) also returns MLX's freed buffers to the system."""
        freed = self.snapshots.free(handles)
        if release_memory:
            mx.clear_cache()
            release_freed_memory(collect=False)
        return freed

    def layout(self) -> CacheLayout:
        """The live model's cache layout (and its MTP head's): what a snapshot file must fit."""
        if self._layout is None:
            self._layout = self._probe()
        return self._layout

    def encode_snapshot(self, handle: int, metadata: dict[str, str],
                        free_after: bool = False) -> tuple[memoryview, float]:
        """A held snapshot as safetensors bytes (one host copy; the file is written off this
        thread) and the seconds the copy held this thread; `free_after`: the snapshot is dropped
        once copied. KeyError: no such snapshot."""
        tic = time.perf_counter()
        try:
            return encode(self.snapshots.get(handle), metadata), time.perf_counter() - tic
        finally:
            if free_after:
                self.snapshots.free([handle])

    def load_snapshot(self, source: str | bytes, length: int) -> tuple[int, int]:
        """A verified file (its path, or its bytes) as a new snapshot, checked against the cache
        layout: (handle, bytes held). `SnapshotFileError` when it does not fit."""
        snap = decode(source, length, self.layout())
        return self.snapshots.add(snap), snap.nbytes

    def clear(self) -> None:
        self.snapshots.clear()
        self.features.clear()

    def reset_peak(self) -> int:
        """MLX's peak memory so far, then reset."""
        peak = mx.get_peak_memory()
        mx.reset_peak_memory()
        return peak

    def release_idle(self) -> None:
        """Drained after a burst: MLX's freed buffers (prefill chunks and batch states, which MLX
        keeps for reuse up to its cache limit) go back to the device; a lone agent's few buffers
        stay below the bound and stay cached. On CUDA the bound also counts what the driver's pool
        still reserves beyond what it hands out: after a 64-stream burst on an H200 MLX's cache held
        0.07 GB but the pool 104 GB more than MLX used, which `mx.clear_cache()` gave back (142.6 ->
        38.1 GB); the old test of MLX's cache alone never fired and the device stayed at 139 GB."""
        cached = mx.get_cache_memory()
        before = self._cuda.read() if self._cuda is not None else None
        spare = before.reserved - before.used if before is not None else 0
        if cached + spare <= self._idle_cache_bytes:
            return
        mx.clear_cache()
        if self._cuda is None or before is None:
            log.info("idle: gave %.2f GB of MLX's buffer cache back (%.2f GB in use)", cached / 1e9,
                     mx.get_active_memory() / 1e9)
            return
        after = self._cuda.read()
        log.info("idle: gave %.2f GB of MLX's buffer cache back (%.2f GB in use); CUDA pool reserved "
                 "%.2f GB -> %.2f GB (high %.2f GB); device in use %s GB", cached / 1e9,
                 mx.get_active_memory() / 1e9, before.reserved / 1e9, after.reserved / 1e9,
                 after.reserved_high / 1e9, "?" if after.device_used is None else f"{after.device_used / 1e9:.2f}")

    def stats(self) -> dict[str, int]:
        """The `EngineStats` fields of what is held and of the device's memory."""
        return {"snapshots": len(self.snapshots), "snapshot_bytes": self.snapshots.bytes,
                "features": len(self.features), "feature_bytes": self.features.bytes,
                "active_memory_bytes": mx.get_active_memory(), "cache_memory_bytes": mx.get_cache_memory(),
                "peak_memory_bytes": mx.get_peak_memory(), **self._cuda_stats()}

    def _cuda_stats(self) -> dict[str, int]:
        if self._cuda is None:
            return {}
        pool = self._cuda.read()
        return {"cuda_pool_reserved_bytes": pool.reserved, "cuda_pool_used_bytes": pool.used,
                "cuda_pool_reserved_high_bytes": pool.reserved_high,
                **({"device_used_bytes": pool.device_used} if pool.device_used is not None else {})}

"""What the CUDA driver holds for this process, beside MLX's own account (GPU thread only).

Place in the actor graph: inside the engine, read by `EngineCore.stats()` on the GPU thread and
reported through `EngineStats` to `/metrics` (`gpu_memory_bytes{kind="cuda_pool_reserved"}` and
friends). MLX's allocator (`mx.get_active_memory`, `mx.get_cache_memory`) counts its arrays and
its buffer cache; under them MLX allocates with `cudaMallocAsync` from the device's default
memory pool, and the driver keeps memory returned to that pool *reserved* (still the process's
in `nvidia-smi`) until a synchronization trims it past the pool's release threshold. Issue 17.1
asked where ~100 GB held after a 64-stream burst go when MLX accounts for 38 GB: this module
reads the pool (reserved, in use, high-water) and the device's free memory through the public
CUDA driver API (`libcuda.so.1`, ctypes); the engine's idle release counts the pool's unused
reservation (`mx.clear_cache()` gives it back; measured on an H200, no trim needed).

Nothing here touches MLX: the pool is the driver's object, shared with MLX by design
(`cudaDeviceGetDefaultMemPool`). Where there is no CUDA driver (CPU, Metal) `CudaMemory.open`
returns None and the engine reports nothing more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass

# CUmemPool_attribute (cuda.h)
_RESERVED_MEM_CURRENT = 5
_RESERVED_MEM_HIGH = 6
_USED_MEM_CURRENT = 7


@dataclass(frozen=True)
class PoolReading:
    """One look at the device: the default pool's bytes and the device's memory in use."""

    reserved: int  # the pool holds from the device (its share of nvidia-smi's figure)
    used: int  # of which handed out (MLX's active arrays and its buffer cache live here)
    reserved_high: int  # the most the pool held at once since the process started
    device_used: int | None  # the whole device's memory in use (every process), None if unknown


class CudaMemory:
    """The device's default memory pool through the driver API."""

    def __init__(self, lib: ctypes.CDLL, pool: ctypes.c_void_p) -> None:
        self._lib = lib
        self._pool = pool

    @classmethod
    def open(cls, device: int = 0) -> CudaMemory | None:
        """The default pool of `device`, or None where there is no CUDA driver or no pool."""
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            return None
        dev = ctypes.c_int()
        pool = ctypes.c_void_p()
        try:
            if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
                return None
            if lib.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev) != 0 or not pool.value:
                return None
        except AttributeError:  # a driver without memory pools
            return None
        return cls(lib, pool)

    def _attribute(self, attr: int) -> int:
        value = ctypes.c_uint64()
        if self._lib.cuMemPoolGetAttribute(self._pool, attr, ctypes.byref(value)) != 0:
            return 0
        return int(value.value)

    def read(self) -> PoolReading:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        # needs the thread's current context: the GPU thread has MLX's (the primary context)
        known = self._lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
        return PoolReading(reserved=self._attribute(_RESERVED_MEM_CURRENT), used=self._attribute(_USED_MEM_CURRENT),
                           reserved_high=self._attribute(_RESERVED_MEM_HIGH),
                           device_used=int(total.value - free.value) if known else None)

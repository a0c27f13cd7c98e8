"""Where the GPUExecutor's engine runs (`EngineConfig.engine_process`): in a process of its own
(`engine_process.EngineProcess`; then this process never imports MLX) or on a thread of the
server's (`local_engine.LocalEngine`).

"auto" is the process where MLX sees a GPU (Metal or CUDA): there a batch-1 step
is bound by the host launching kernels, and in the server's process every millisecond of Python
on the event loop (HTTP, SSE encoding, the actors) could delay it through the shared GIL. On the
CPU backend the compute dominates and the thread is kept (tests and CPU servers use it).
"""

from __future__ import annotations

import logging
import subprocess
import sys

from mlx_relay.config import EngineConfig
from mlx_relay.engine.hosting.engine_process import EngineProcess
from mlx_relay.engine.hosting.handle import EngineCallbacks, EngineHandle

_GPU_PROBE = ("import mlx.core as mx; c = getattr(mx, 'cuda', None); "
              "print(int(bool(mx.metal.is_available() or (c and c.is_available()))))")


def sees_gpu() -> bool:
    """Whether MLX sees a GPU (Metal or CUDA), asked in a throwaway interpreter: the server's
    process never imports MLX when its engine runs in a process of its own, and on CUDA the
    question alone opens a device context (about 0.5 GB of device memory on an H200, measured in
    benchmarks/results/gpu-h200-2026-11-24f/memory/) that would stay with it for its whole life."""
    try:
        probe = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True, timeout=120,
                               stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0 and probe.stdout.strip() == "1"


def wants_process(config: EngineConfig) -> bool:
    if config.engine_process != "auto":
        return config.engine_process == "on"
    return sees_gpu()


def open_engine(own_process: bool, callbacks: EngineCallbacks) -> EngineHandle:
    """The engine, in a process of its own (`own_process`) or on a thread of this one; not
    started yet (then `BootEngine`). Call it on the main thread: for the thread it imports MLX, and
    MLX's CPU backend can abort the process at exit when MLX was first loaded on a thread that has
    ended since (see `gpu_thread.py`; tests/test_shutdown.py)."""
    if own_process:
        return EngineProcess(callbacks, log_level=logging.getLogger("mlx_relay").getEffectiveLevel())
    # imported here, the one place that runs the engine in this process: importing it loads MLX,
    # which a server whose engine runs in a process of its own never does
    from mlx_relay.engine.hosting.local_engine import LocalEngine

    return LocalEngine(callbacks)

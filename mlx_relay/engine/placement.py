"""Where the GPUExecutor's engine runs (`EngineConfig.engine_process`): in a process of its own
(`engine_process.EngineProcess`) or on a thread of the server's (`local_engine.LocalEngine`).

"auto" is the process where MLX's default device is a GPU (Metal or CUDA): there a batch-1 step
is bound by the host launching kernels, and in the server's process every millisecond of Python
on the event loop (HTTP, SSE encoding, the actors) could delay it through the shared GIL. On the
CPU backend the compute dominates and the thread is kept (tests and CPU servers use it).
"""

from __future__ import annotations

import logging

from mlx_relay.config import EngineConfig, SpecPrefillConfig
from mlx_relay.engine.engine_process import EngineProcess
from mlx_relay.engine.handle import EngineCallbacks, EngineHandle
from mlx_relay.engine.loader import detect_backend
from mlx_relay.engine.local_engine import LocalEngine


def wants_process(config: EngineConfig) -> bool:
    if config.engine_process != "auto":
        return config.engine_process == "on"
    return detect_backend() != "cpu"  # asks MLX which devices it has; runs nothing


def open_engine(config: EngineConfig, specprefill: SpecPrefillConfig, callbacks: EngineCallbacks) -> EngineHandle:
    """The engine `config` asks for, not started yet."""
    if wants_process(config):
        return EngineProcess(config, specprefill, callbacks,
                             log_level=logging.getLogger("mlx_relay").getEffectiveLevel())
    return LocalEngine(config, specprefill, callbacks)

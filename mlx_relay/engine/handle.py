"""The GPUExecutor's one view of its engine, wherever the engine runs.

    GPUExecutor --EngineHandle--> LocalEngine (a GPUThread in the server process)
                              or  EngineProcess (the same LocalEngine in a process of its own)

Both implement `EngineHandle`: commands return concurrent futures (or nothing, when told), and
the engine reports through `EngineCallbacks`, called on a thread of its own (the GPU thread, or
the engine process's reader thread): each step's output, the boot's progress, and its death.
The actor's message handling is one code path for both; `placement.py` picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from mlx_relay.engine.core import StepOutput
from mlx_relay.messages.gpu import EngineStats, Generate, ModelInfo, WarmupReport
from mlx_relay.messages.prefix_cache import LoadSnapshot, SaveSnapshot, SnapshotLoaded, SnapshotSaved


@dataclass(frozen=True)
class EngineCallbacks:
    """What the engine reports, from a thread of its own (never the event loop's)."""

    on_output: Callable[[StepOutput], None]  # a step's output (not empty)
    on_fatal: Callable[[str], None]  # the engine died (the reason): nothing it holds will answer
    on_progress: Callable[[str], None]  # a boot phase ("loading ...")


class EngineHandle(Protocol):
    @property
    def pid(self) -> int | None:
        """The engine's own process (None: it runs in this one)."""

    def start(self) -> None:
        """Start the GPU thread (or the process); blocking, briefly."""

    def boot(self) -> Future[ModelInfo]:
        """Set memory limits, load the model (and SpecPrefill's draft), build the engine, probe
        the snapshot identity; then steps run whenever the engine has work."""

    def add(self, rid: int, req: Generate) -> None: ...

    def cancel(self, rid: int) -> None: ...

    def free_snapshots(self, handles: list[int], release_memory: bool = False) -> None: ...

    def free_features(self, hashes: list[str]) -> None: ...

    def warmup(self) -> Future[WarmupReport]: ...

    def stats(self) -> Future[EngineStats]: ...

    def save_snapshot(self, msg: SaveSnapshot) -> Future[SnapshotSaved]:
        """Copy the snapshot to host bytes on the GPU thread (between steps), write its file on a
        writer thread; the outcome (errors included) as the store's message."""

    def load_snapshot(self, msg: LoadSnapshot) -> Future[SnapshotLoaded]:
        """Check the file on a reader thread, load it on the GPU thread; the outcome (errors
        included) as the store's message."""

    def close(self) -> Future[StepOutput]:
        """End every request (their events in the output) and drop all device state."""

    def stop(self, timeout_s: float) -> None:
        """Finish what is queued and stop (blocking; a process past `timeout_s` is killed)."""

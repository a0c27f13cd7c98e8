"""The GPUExecutor's one view of its engine, wherever the engine runs.

    GPUExecutor --EngineHandle--> LocalEngine (a GPUThread in the server process)
                              or  EngineProcess (the same LocalEngine in a process of its own)

Both implement `EngineHandle`: they carry the protocol's commands (`protocol.py`) as they are,
an asked one's answer as a concurrent future, and
the engine reports through `EngineCallbacks`, called on a thread of its own (the GPU thread, or
the engine process's reader thread): each step's output, the boot's progress, and its death.
The actor's message handling is one code path for both; `placement.py` picks one.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from mlx_relay.engine.protocol import Asked, R, StepOutput, Told


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
        """Start the GPU thread (or the process); blocking, briefly. Then `BootEngine` first."""

    def tell(self, command: Told) -> None:
        """Apply `command` between steps, in order; nobody waits."""

    def ask(self, command: Asked[R]) -> Future[R]:
        """Apply `command` between steps, in order with the told ones; its answer (or error)."""

    def stop(self, timeout_s: float) -> None:
        """Finish what is queued and stop (blocking; a process past `timeout_s` is killed)."""

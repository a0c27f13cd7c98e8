"""The engine's protocol: every command the engine takes and what it answers, defined once (no MLX).

    GPUExecutor --tell(Told) / ask(Asked[R]) -> Future[R]--> EngineHandle (handle.py)
        LocalEngine (local_engine.py): GPUThread -> EngineCore.apply(command)   [or PipelineLeader.apply]
        EngineProcess (engine_process.py) ==wire.py frames== process_main.py -> LocalEngine

A command is a msgspec struct, tagged by its class name, so the process host and the pipeline
carry any command as it is (`Command` below is the tagged union they decode). `Told` commands
answer nothing; `Asked[R]` commands answer an `R` (`answer_type` reads it off the class). The
hosts never look inside a command: the `EngineCore` applies it (`EngineCore.apply`), except the
few a host runs itself, marked `host = True` (the boot, and the prefix cache's disk tier, whose
files are written and read on the host's threads around a core command).

`lockstep` says what a pipeline (`pipeline_sync.py`) does with a command on rank 0: "kept" (applied
now, replayed on every rank before the next step), "now" (sent to every rank and applied there at
once: its own steps run in lockstep), "local" (rank 0 only: it reads and changes nothing the ranks
share) or "refused" (no pipeline can run it).

Adding a command: a struct here (and in `Command`), its case in `EngineCore.apply`, and the
actor that issues it. Nothing in between changes.

`StepOutput` is what a step returns: the events of each request's stream and the side results the
policy actors are told.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

import msgspec

from mlx_relay.config import EngineConfig, SpecPrefillConfig
from mlx_relay.messages.gpu import (
    EmbeddedVectors,
    EngineStats,
    Finished,
    Generate,
    ModelInfo,
    TokenDelta,
    WarmupReport,
)
from mlx_relay.messages.prefix_cache import LoadSnapshot, SaveSnapshot, SnapshotLoaded, SnapshotSaved, SnapshotTaken
from mlx_relay.messages.specprefill import ScoringOutcome
from mlx_relay.messages.text_mtp import MTPOutcome
from mlx_relay.messages.vision import FeaturesEncoded

R = TypeVar("R")

Lockstep = Literal["kept", "now", "local", "refused"]

# one item of a request's stream (an exception ends it; an embedding request's one item: its vectors)
Event = TokenDelta | Finished | EmbeddedVectors | Exception


@dataclass
class StepOutput:
    """One step's results: stream events by row, and what the policy actors are told."""

    events: list[tuple[int, Event]] = field(default_factory=list)
    snapshots: list[SnapshotTaken] = field(default_factory=list)  # -> PrefixCacheStore
    scored: list[ScoringOutcome] = field(default_factory=list)  # -> SpecPrefillScorer
    features: list[FeaturesEncoded] = field(default_factory=list)  # -> VisionExecutor
    mtp: list[MTPOutcome] = field(default_factory=list)  # -> TextMTPExecutor

    def __bool__(self) -> bool:
        return bool(self.events or self.snapshots or self.scored or self.features or self.mtp)


class Told(msgspec.Struct, frozen=True, tag=True):
    """A command nobody waits for (applied between steps, in order)."""

    lockstep: ClassVar[Lockstep] = "kept"
    host: ClassVar[bool] = False


class Asked(msgspec.Struct, Generic[R], frozen=True, tag=True):
    """A command answered with an `R` (or its error)."""

    lockstep: ClassVar[Lockstep] = "local"
    host: ClassVar[bool] = False


def answer_type(command: type[Told] | type[Asked[Any]]) -> Any:
    """What `command` answers (None: a told command)."""
    for base in getattr(command, "__orig_bases__", ()):
        if typing.get_origin(base) is Asked:
            return typing.get_args(base)[0]
    return None


# -- told ------------------------------------------------------------------------------------------
class AddRow(Told, frozen=True):
    """A request joins the engine as row `rid` (its stream's id)."""

    rid: int
    req: Generate


class CancelRow(Told, frozen=True):
    rid: int


class FreeSnapshotHandles(Told, frozen=True):
    """Drop snapshots; `release_memory` (a flush) also returns MLX's freed buffers to the system."""

    handles: list[int]
    release_memory: bool = False


class FreeFeatureHashes(Told, frozen=True):
    hashes: list[str]


# -- asked -----------------------------------------------------------------------------------------
class BootEngine(Asked[ModelInfo], frozen=True):
    """Set memory limits, load the model (and SpecPrefill's draft), build the engine, probe the
    snapshot identity; steps run from then on whenever the engine has work. The host's own."""

    host: ClassVar[bool] = True
    engine: EngineConfig
    specprefill: SpecPrefillConfig


class RunWarmup(Asked[WarmupReport], frozen=True):
    """Compile the kernels the server uses and calibrate MTP (before traffic)."""

    lockstep: ClassVar[Lockstep] = "now"


class ReadStats(Asked[EngineStats], frozen=True):
    pass


class ResetPeakMemory(Asked[int], frozen=True):
    """Start MLX's peak-memory count over (on every rank); answers the peak until now (bytes), so
    that one run's peak can be read apart from the warm-up's or another run's."""

    lockstep: ClassVar[Lockstep] = "now"


class CloseEngine(Asked[StepOutput], frozen=True):
    """End every request (their events in the answer) and drop all device state."""

    lockstep: ClassVar[Lockstep] = "now"


class WriteSnapshot(Asked[SnapshotSaved], frozen=True):
    """Copy the snapshot to host bytes on the GPU thread (between steps) and write its file on a
    writer thread; the outcome, errors included, as the store's message. The host's own."""

    host: ClassVar[bool] = True
    msg: SaveSnapshot


class ReadSnapshot(Asked[SnapshotLoaded], frozen=True):
    """Check the file on a reader thread, load it on the GPU thread; the outcome, errors included,
    as the store's message. The host's own."""

    host: ClassVar[bool] = True
    msg: LoadSnapshot


# the core's halves of WriteSnapshot / ReadSnapshot (the host runs them; they never cross a pipe)
class CopySnapshotOut(Asked[tuple[memoryview, float]], frozen=True):
    """A held snapshot as safetensors bytes and the seconds the copy took (KeyError: no such
    snapshot); `free_after`: dropped once copied."""

    lockstep: ClassVar[Lockstep] = "refused"
    handle: int
    metadata: dict[str, str]
    free_after: bool = False


class LoadSnapshotFile(Asked[tuple[int, int]], frozen=True):
    """A verified file as a new snapshot: (handle, bytes held)."""

    lockstep: ClassVar[Lockstep] = "refused"
    path: str
    length: int


class AddEmbedding(Told, frozen=True):
    """An embedding request (`rid` its stream): queued, its inputs run within the steps' prefill
    share (`engine/embeddings/jobs.py`), its `EmbeddedVectors` the stream's event once all have run.
    `CancelRow(rid)` drops it. Not on a pipeline."""

    lockstep: ClassVar[Lockstep] = "refused"
    rid: int
    inputs: list[list[int]]


Command = (AddRow | CancelRow | FreeSnapshotHandles | FreeFeatureHashes | BootEngine | RunWarmup | ReadStats
           | ResetPeakMemory | CloseEngine | WriteSnapshot | ReadSnapshot | CopySnapshotOut | LoadSnapshotFile
           | AddEmbedding)

"""Every rank's EngineCore in lockstep: rank 0 decides, the others replay (GPU thread only).

    rank 0: LocalEngine -> GPUThread -> PipelineLeader -> EngineCore (this stage)
                                           | each step's commands, one all_sum
    rank r: pipeline_follower -> follow() -> EngineCore (its stage)

A pipelined model only runs when every rank runs the same forward at the same time: the stages'
sends and receives must pair up. So every rank holds the same EngineCore and the same rows, and
steps it the same way: rank 0 (the server, whose GPUExecutor owns the requests) applies each
command (add, cancel, free snapshots, free features) at once and keeps it; before its next step
(or warm-up, or close) it broadcasts the kept commands and the action to every rank in one frame
(the engine process's msgpack structs of `wire.py`, as bytes through `mx.distributed.all_sum`
over uint8, as mlx-lm's server shares its requests), and each follower applies them in the same
order before the same step. Scheduling is a function of the commands, the sampled tokens are a
function of the logits, which every rank computes from the last stage's hidden states
(`Stage.share`), and the sampling seeds travel in the commands: every rank makes the same
decisions and never needs to be told a token.

Snapshots live per rank, each holding its own layers' state under the same handle (handles are
counted in the same order everywhere), so a prefix-cache plan that names handle h restores every
stage's part of h. The disk tier is off with a pipeline (`EngineConfig` refuses it): its files
would have to be one per rank.

A follower waits for its next frame inside the collective; MLX's ring backend waits there by
polling, which keeps a CPU core busy while the server is idle (docs/pipeline.md). A collective
whose peer died never returns: each rank's liveness is watched outside MLX (`pipeline_watch.py`).
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np

from mlx_relay.engine.core import EngineCore, StepOutput
from mlx_relay.engine.pipeline_watch import WatchLeader
from mlx_relay.engine.snapshot_codec import CacheLayout
from mlx_relay.engine.wire import AddRow, CancelRow, FreeFeatureHashes, FreeSnapshotHandles
from mlx_relay.messages.gpu import DraftInfo, EngineStats, Generate, WarmupReport

log = logging.getLogger(__name__)

FRAME = 4096  # bytes of the first all_sum: a step's usual commands fit; a longer frame takes a second


class StepOnce(msgspec.Struct, frozen=True, tag=True):
    """Step the engine once (after the commands before it)."""


class WarmUp(msgspec.Struct, frozen=True, tag=True):
    """Run the engine's warm-up (its own steps, the same on every rank)."""


class CloseCore(msgspec.Struct, frozen=True, tag=True):
    """End every request and drop the device state."""


class StopFollowing(msgspec.Struct, frozen=True, tag=True):
    """The server is stopping: the follower leaves its loop."""


Command = (AddRow | CancelRow | FreeSnapshotHandles | FreeFeatureHashes | StepOnce | WarmUp | CloseCore | StopFollowing
           | WatchLeader)  # WatchLeader: the first frame only (pipeline_boot)

_decoder = msgspec.msgpack.Decoder(list[Command])  # type: ignore[arg-type]


class PipelineUnsupported(RuntimeError):
    """An engine command no pipeline rank can run (the prefix cache's disk tier)."""


def share_commands(group: Any, commands: list[Command] | None) -> list[Command]:
    """Rank 0 passes its commands, the others None; every rank returns rank 0's commands."""
    head = np.zeros(FRAME, dtype=np.uint8)
    data = b""
    if commands is not None:
        data = msgspec.msgpack.encode(commands)
        head[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)
        if len(data) <= FRAME - 4:
            head[4:4 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    shared = np.array(mx.distributed.all_sum(mx.array(head), group=group))
    size = int.from_bytes(shared[:4].tobytes(), "little")
    if size <= FRAME - 4:
        payload = shared[4:4 + size].tobytes()
    else:
        body = np.frombuffer(data, dtype=np.uint8) if commands is not None else np.zeros(size, dtype=np.uint8)
        payload = np.array(mx.distributed.all_sum(mx.array(body), group=group)).tobytes()
    return commands if commands is not None else _decoder.decode(payload)


class PipelineLeader:
    """Rank 0's EngineCore as the LocalEngine sees it: the same commands, each also kept for the
    followers, who get them before the step, warm-up or close that follows."""

    def __init__(self, core: EngineCore, group: Any) -> None:
        self.core = core
        self._group = group
        self._kept: list[Command] = []

    def _tell(self, action: Command) -> None:
        commands, self._kept = [*self._kept, action], []
        share_commands(self._group, commands)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    @property
    def draft(self) -> DraftInfo | None:
        return self.core.draft

    def add(self, rid: int, req: Generate) -> None:
        self.core.add(rid, req)
        self._kept.append(AddRow(rid, req))

    def cancel(self, rid: int) -> None:
        self.core.cancel(rid)
        self._kept.append(CancelRow(rid))

    def free_snapshots(self, handles: list[int], release_memory: bool = False) -> int:
        freed = self.core.free_snapshots(handles, release_memory)
        self._kept.append(FreeSnapshotHandles(handles, release_memory))
        return freed

    def free_features(self, hashes: list[str]) -> None:
        self.core.free_features(hashes)
        self._kept.append(FreeFeatureHashes(hashes))

    def step(self) -> StepOutput:
        self._tell(StepOnce())
        return self.core.step()

    def warmup(self) -> WarmupReport:
        self._tell(WarmUp())
        return self.core.warmup()

    def close(self) -> StepOutput:
        self._tell(CloseCore())
        return self.core.close()

    def stop_followers(self) -> None:
        self._tell(StopFollowing())

    def stats(self) -> EngineStats:
        return self.core.stats()

    def snapshot_layout(self) -> CacheLayout:
        return self.core.snapshot_layout()

    def encode_snapshot(self, handle: int, metadata: dict[str, str],
                        free_after: bool = False) -> tuple[memoryview, float]:
        raise PipelineUnsupported("snapshot files are not written with a pipeline")

    def load_snapshot(self, source: str | bytes, length: int) -> tuple[int, int]:
        raise PipelineUnsupported("snapshot files are not loaded with a pipeline")


def follow(core: EngineCore, group: Any) -> None:
    """A follower's loop: apply rank 0's commands in order, step when it steps; returns when told
    to stop."""
    while True:
        for cmd in share_commands(group, None):
            if isinstance(cmd, AddRow):
                core.add(cmd.rid, cmd.req)
            elif isinstance(cmd, CancelRow):
                core.cancel(cmd.rid)
            elif isinstance(cmd, FreeSnapshotHandles):
                core.free_snapshots(cmd.handles, cmd.release_memory)
            elif isinstance(cmd, FreeFeatureHashes):
                core.free_features(cmd.hashes)
            elif isinstance(cmd, StepOnce):
                core.step()
            elif isinstance(cmd, WarmUp):
                core.warmup()
            elif isinstance(cmd, CloseCore):
                core.close()
            elif isinstance(cmd, StopFollowing):
                log.info("pipeline rank %d: the server stopped", group.rank())
                return

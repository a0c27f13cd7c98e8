"""Every rank's EngineCore in lockstep: rank 0 decides, the others replay (GPU thread only).

    rank 0: LocalEngine -> GPUThread -> PipelineLeader -> EngineCore (this stage)
                                           | each step's commands, one all_sum
    rank r: pipeline_follower -> follow() -> EngineCore (its stage)

A pipelined model only runs when every rank runs the same forward at the same time: the stages'
sends and receives must pair up. So every rank holds the same EngineCore and the same rows, and
steps it the same way: rank 0 (the server, whose GPUExecutor owns the requests) applies each
command of the protocol (`protocol.py`) at once and, as its `lockstep` says, keeps it (add,
cancel, free snapshots, free features); before its next step (or warm-up, or close) it broadcasts
the kept commands and the action to every rank in one frame (the protocol's msgpack structs, as
bytes through `mx.distributed.all_sum` over uint8, as mlx-lm's server shares its requests), and
each follower applies them in the same order before the same step. Scheduling is a function of
the commands, the sampled tokens are a function of the logits, which every rank computes from the
last stage's hidden states
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

from mlx_relay.engine.hosting.pipeline_watch import WatchLeader
from mlx_relay.engine.protocol import Asked, Command, StepOutput, Told
from mlx_relay.engine.step.core import EngineCore

log = logging.getLogger(__name__)

FRAME = 4096  # bytes of the first all_sum: a step's usual commands fit; a longer frame takes a second


class StepOnce(msgspec.Struct, frozen=True, tag=True):
    """Step the engine once (after the commands before it)."""


class StopFollowing(msgspec.Struct, frozen=True, tag=True):
    """The server is stopping: the follower leaves its loop."""


Shared = Command | StepOnce | StopFollowing | WatchLeader  # WatchLeader: the first frame only (pipeline_boot)

_decoder = msgspec.msgpack.Decoder(list[Shared])  # type: ignore[arg-type]


class PipelineUnsupported(RuntimeError):
    """An engine command no pipeline rank can run (the prefix cache's disk tier)."""


def share_commands(group: Any, commands: list[Shared] | None) -> list[Shared]:
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
    shared_commands = commands if commands is not None else _decoder.decode(payload)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("rank %d frame of %d bytes: %s", group.rank(), size, [type(c).__name__ for c in shared_commands])
    return shared_commands


class PipelineLeader:
    """Rank 0's EngineCore as the LocalEngine sees it: it applies the same commands, and shares
    them with the followers as each command's `lockstep` says (`protocol.py`): kept for the
    followers, who get them before the step, warm-up or close that follows; sent at once; or not."""

    def __init__(self, core: EngineCore, group: Any) -> None:
        self.core = core
        self._group = group
        self._kept: list[Shared] = []

    def _tell(self, action: Shared) -> None:
        commands, self._kept = [*self._kept, action], []
        share_commands(self._group, commands)

    @property
    def has_work(self) -> bool:
        return self.core.has_work

    def apply(self, command: Told | Asked[Any]) -> Any:
        match command.lockstep:
            case "refused":
                raise PipelineUnsupported(f"{type(command).__name__} is not run with a pipeline")
            case "now":
                self._tell(command)  # type: ignore[arg-type]
            case "kept":
                result = self.core.apply(command)
                self._kept.append(command)  # type: ignore[arg-type]
                return result
        return self.core.apply(command)

    def step(self) -> StepOutput:
        self._tell(StepOnce())
        return self.core.step()

    def stop_followers(self) -> None:
        self._tell(StopFollowing())


def follow(core: EngineCore, group: Any) -> None:
    """A follower's loop: apply rank 0's commands in order, step when it steps; returns when told
    to stop."""
    while True:
        for cmd in share_commands(group, None):
            if isinstance(cmd, StepOnce):
                core.step()
            elif isinstance(cmd, StopFollowing):
                log.info("pipeline rank %d: the server stopped", group.rank())
                return
            elif isinstance(cmd, Told | Asked):
                core.apply(cmd)

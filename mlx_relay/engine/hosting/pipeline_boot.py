"""A pipeline rank's start: join the process group, load this rank's stage of the model, and (on
a rank other than 0) follow rank 0's engine until it stops (GPU thread only).

    mlx.launch -n 2 -- mlx-relay serve MODEL --pipeline
        rank 0: the server; LocalEngine._boot -> lead_group, load_stage -> PipelineLeader
        rank 1..: cli -> run_follower -> follow_group, load_stage -> pipeline_sync.follow

Right after joining the group, before the model loads, every rank's liveness is watched outside
MLX (`pipeline_watch.py`): rank 0 listens, says where in its first frame, and each follower
connects. A follower whose rank 0 is gone exits 1 at once (`os._exit`: its main thread may be
inside a collective that never returns, and it holds nothing to save); rank 0's side is the
LocalEngine's (it fails its engine, and the server exits non-zero).

The model is loaded lazily (`mlx_vlm.load(lazy=True)`), cut to this rank's layers
(`pipeline_stage.shard_language_model`), and only then evaluated: a rank reads its own layers'
weights (and the embedding, head and vision tower every rank keeps) and never the others'. A
follower's main thread is its GPU thread: the process has no server, no actors, no other MLX user.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec

from mlx_relay.config import EngineConfig, PipelineConfig, ServerConfig, SpecPrefillConfig
from mlx_relay.engine.hosting.pipeline_sync import follow, share_commands
from mlx_relay.engine.hosting.pipeline_watch import FollowerWatch, LeaderWatch, WatchLeader
from mlx_relay.engine.models.checkpoint import resolve_model_path
from mlx_relay.engine.models.loader import LoadedModel, add_copies, apply_memory_limits, load_model, prefix_cache_budget
from mlx_relay.engine.models.pipeline_stage import Stage, UnsupportedSplit, default_transfer, shard_language_model
from mlx_relay.engine.step.core import EngineCore
from mlx_relay.errors import PipelineSetupError

log = logging.getLogger(__name__)


def join_group(config: PipelineConfig) -> Any:
    """This process's `mx.distributed` group: at least two processes, this one at the rank the
    launcher gave it."""
    try:
        group = mx.distributed.init(strict=True, backend=config.backend)
    except Exception as exc:  # MLX says why (no hostfile, no backend of that name, ...)
        raise PipelineSetupError(f"cannot join the pipeline's process group (backend {config.backend}): {exc}. "
                                 "Start every rank with mlx.launch") from exc
    if group.size() < 2:
        raise PipelineSetupError("--pipeline needs two or more processes (mlx.launch -n 2 ...)")
    if group.rank() != config.rank:
        raise PipelineSetupError(f"the launcher says rank {config.rank}, the process group {group.rank()}")
    return group


def lead_group(config: PipelineConfig, on_lost: Callable[[str], None]) -> tuple[Any, FollowerWatch]:
    """Rank 0: the group, and the watch on every follower (`on_lost` from the watch's thread)."""
    group = join_group(config)
    watch = FollowerWatch(config.leader_host, group.size(), on_lost)
    share_commands(group, [watch.address])
    watch.accept()
    return group, watch


def follow_group(config: PipelineConfig, on_lost: Callable[[str], None]) -> tuple[Any, LeaderWatch]:
    """A follower: the group, and its watch on rank 0 (`on_lost` from the watch's thread)."""
    group = join_group(config)
    first = share_commands(group, None)
    if len(first) != 1 or not isinstance(first[0], WatchLeader):
        raise PipelineSetupError(f"rank 0's first frame is not its watch's address: {first!r}")
    return group, LeaderWatch(first[0], group.rank(), on_lost)


def _leader_lost(reason: str) -> None:
    """A follower whose rank 0 is gone: exit 1 now (its main thread may never leave the collective)."""
    log.error("%s: this rank exits", reason)
    logging.shutdown()
    os._exit(1)


def load_stage(path: Path, config: PipelineConfig, group: Any) -> tuple[LoadedModel, Stage]:
    """The model with only this rank's layers evaluated, and its stage."""
    loaded = load_model(path, lazy=True)
    try:
        start, end = shard_language_model(loaded.model.language_model, group.rank(), group.size(), config.split)
    except UnsupportedSplit as exc:
        raise PipelineSetupError(str(exc)) from exc
    transfer = default_transfer() if config.transfer == "auto" else config.transfer
    stage = Stage(group, group.rank(), group.size(), start, end, transfer)
    mx.eval(loaded.model.parameters())
    log.info("pipeline rank %d of %d: layers %d..%d, hidden states by %s", stage.rank, stage.size, stage.start,
             stage.end - 1, "send/recv" if transfer == "p2p" else "all_sum")
    return loaded, stage


def run_follower(config: EngineConfig, specprefill: SpecPrefillConfig) -> int:
    """A rank other than 0: the same engine as rank 0's, stepped when rank 0 steps; returns 0
    once rank 0 stops (and exits 1 if rank 0 dies)."""
    apply_memory_limits(config)
    group, watch = follow_group(config.pipeline, _leader_lost)
    loaded, stage = load_stage(Path(config.model_path), config.pipeline, group)
    add_copies(loaded, config)
    core = EngineCore(loaded, config, prefix_cache=prefix_cache_budget(config) > 0,
                      draft_model=specprefill.draft_model, stage=stage)
    follow(core, group)
    watch.done()
    return 0


def serve_follower(config: ServerConfig) -> int:
    """`mlx-relay serve --pipeline` on a rank other than 0: no server, the engine only. It ignores
    SIGINT and SIGTERM (as the engine process does): a Ctrl-C in mlx.launch's terminal or a service
    manager's SIGTERM reaches every rank, and rank 0, which drains on them, still needs the other
    ranks' layers until it tells them to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = msgspec.structs.replace(config.engine, model_path=str(resolve_model_path(config.model)))
    specprefill = config.specprefill
    if specprefill.draft_model is not None:
        specprefill = msgspec.structs.replace(specprefill, draft_model=str(resolve_model_path(specprefill.draft_model)))
    return run_follower(engine, specprefill)

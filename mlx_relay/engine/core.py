"""The engine core: one step is schedule -> execute -> update (GPU thread only).

    plan = scheduler.schedule()      # StepPlan: which rows join which lane, which are scored
    executed = self._execute(plan)   # rows start in their lanes; each lane steps once within the
                                     # step's token budget (token_budget.py: decodes first); a draft chunk
    return self._update(executed)    # output stage: text, stops, endings; rows leave their lanes

vLLM v1's `EngineCore.step` and nano-vllm's `step` have this shape. The pieces, one module each:
`scheduler.py` (queue, slots, lane routing), the lanes behind `lanes.Lane` (`mtp_lane.py`,
`plain_lane.py`, `library_lane.py`), `scoring.py` (SpecPrefill's draft, where it lives),
`output.py` (detokenizing, stop strings, finishing), `logits.py` (each row's processor chain),
`snapshots.py` and `features.py` (prefix-cache snapshots and image features behind handles),
`snapshot_codec.py` (snapshots to and from file bytes, for the prefix cache's disk tier).

`step` returns a `StepOutput`: the events of each request's stream and the side results for the
policy actors (snapshots taken, scoring outcomes, features encoded, MTP outcomes), each typed.
A request that fails on its own (embedding, joining, detokenizing) ends with an error and the
batch goes on; if a lane's step fails, that lane's rows end with an error and the lane starts
empty. Its host applies the protocol's commands (`apply`) between steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay.config import EngineConfig
from mlx_relay.engine.cuda_memory import CudaMemory
from mlx_relay.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from mlx_relay.engine.features import FeatureStore
from mlx_relay.engine.kv_lane import KVLane
from mlx_relay.engine.lanes import Lane, LaneStep, RowSpec
from mlx_relay.engine.library_lane import LibraryLane
from mlx_relay.engine.loader import LoadedModel, device_memory_bytes
from mlx_relay.engine.logits import LogitsChains
from mlx_relay.engine.models import UnsupportedModel
from mlx_relay.engine.models.library_kv import uses_library_forward
from mlx_relay.engine.mtp_head import MTPHead
from mlx_relay.engine.mtp_lane import MTPLane
from mlx_relay.engine.output import Ending, OutputStage, RowCounts
from mlx_relay.engine.pipeline_stage import Stage
from mlx_relay.engine.plain_lane import PlainLane
from mlx_relay.engine.protocol import (
    AddRow,
    Asked,
    CancelRow,
    CloseEngine,
    CopySnapshotOut,
    FreeFeatureHashes,
    FreeSnapshotHandles,
    LoadSnapshotFile,
    ReadStats,
    ResetPeakMemory,
    RunWarmup,
    StepOutput,
    Told,
)
from mlx_relay.engine.row_prefill import sparse_row
from mlx_relay.engine.rows import LaneName, Row
from mlx_relay.engine.scheduler import Scheduler, StepPlan
from mlx_relay.engine.scoring import ScoringStage
from mlx_relay.engine.snapshot_codec import CacheLayout, decode, encode, probe_layout
from mlx_relay.engine.snapshots import Snapshot, SnapshotPool
from mlx_relay.engine.token_budget import prefill_budget, split_by_rows, step_budget
from mlx_relay.errors import GenerationFailed
from mlx_relay.memory import release_freed_memory
from mlx_relay.messages.gpu import DraftInfo, EngineStats, Generate, SamplingParams, TokenDelta, WarmupReport
from mlx_relay.messages.prefix_cache import PrefixPlan, SnapshotTaken
from mlx_relay.messages.text_mtp import MTPOutcome
from mlx_relay.messages.vision import FeaturesEncoded
from mlx_relay.runtime.supervision import is_failure

log = logging.getLogger(__name__)


@dataclass
class _Executed:
    steps: list[LaneStep] = field(default_factory=list)
    failed: list[tuple[Row, Exception]] = field(default_factory=list)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, prefix_cache: bool,
                 draft_model: str | None = None, stage: Stage | None = None) -> None:
        self.config = config
        self._model = loaded.model
        info = loaded.info
        tok = loaded.processor.tokenizer if hasattr(loaded.processor, "tokenizer") else loaded.processor
        self._tokenizer = tok
        self._vocab_size = info.vocab_size
        lm = loaded.model.language_model
        # the step's token budget: decoding rows first, prefill chunks in what is left
        self.token_budget = step_budget(config.max_num_batched_tokens, config.prefill_step_size, info.backend,
                                        config.max_num_seqs * max(1, config.mtp_block_size))
        # a model of no family of ours runs its library's forward over KV caches (one lane for all rows)
        generic = uses_library_forward(lm)
        if generic and (stage is not None or draft_model is not None):
            raise UnsupportedModel(f"a pipeline split and SpecPrefill need a model family of the engine's own "
                                   f"({info.model_type} is served through its library's forward)")
        self.lanes: dict[LaneName, Lane] = {
            "plain": KVLane(lm, prefill_step_size=min(config.prefill_step_size, self.token_budget),
                            eos_token_ids=info.eos_token_ids) if generic else
            PlainLane(lm, prefill_batch_size=config.prefill_batch_size,
                               prefill_step_size=config.prefill_step_size, eos_token_ids=info.eos_token_ids,
                               compiled=config.compile_decode,
                               fixed_prefill_shapes=config.prefill_shapes == "fixed"
                               or (config.prefill_shapes == "auto" and info.backend != "cpu"), stage=stage)}
        # a pipeline stage runs no library lane: mlx-vlm's BatchGenerator runs the whole model
        if not prefix_cache and stage is None and not generic:
            self.lanes["library"] = LibraryLane(loaded.model, loaded.processor, max_num_seqs=config.max_num_seqs,
                                                prefill_batch_size=config.prefill_batch_size,
                                                prefill_step_size=min(config.prefill_step_size,
                                                                      self.token_budget))
        mtp_block = None
        if config.mtp and info.has_mtp and config.mtp_max_batch > 0 and not generic:
            # a pipeline stage verifies with the batched forward: mlx-vlm's exact verifier runs the
            # whole model in one call
            exact = stage is None and (config.mtp_verify == "exact"
                                       or (config.mtp_verify == "auto" and info.backend == "metal"))
            head = MTPHead.load(Path(info.model_path), lm, exact=exact)
            self.lanes["mtp"] = MTPLane(lm, head, block_size=config.mtp_block_size,
                                        prefill_step_size=config.prefill_step_size,
                                        eos_token_ids=info.eos_token_ids, exact_verify=exact,
                                        compiled=config.compile_mtp, stage=stage)
            mtp_block = config.mtp_block_size
        self.scheduler = Scheduler(max_num_seqs=config.max_num_seqs, mtp_block=mtp_block,
                                   mtp_max_batch=config.mtp_max_batch,
                                   own_prefill=prefix_cache or stage is not None or generic)
        # the draft (a much smaller model) reads at most a budget's worth of a prompt per step
        self.scoring = ScoringStage(draft_model, tok, min(config.prefill_step_size, self.token_budget))
        self.output = OutputStage()
        self.chains = LogitsChains(tok, info.vocab_size, info.eos_token_ids, config.seed)
        self.snapshots = SnapshotPool()
        self._layout: CacheLayout | None = None  # the caches' layout (the disk tier's check), probed once
        self.features = FeatureStore()
        self._rows: dict[int, Row] = {}  # every row the engine holds, by id
        self._mtp_totals = [0, 0, 0, 0]  # rounds, drafted, accepted, eager rounds (compiled round on)
        self._prefill_totals = [0, 0]  # chunks, rows
        self.prefill_tokens = 0  # prompt tokens the lanes' prefill ran, padding included (all steps)
        # what MLX may keep cached while idle (EngineConfig.idle_cache_bytes)
        self._cuda = CudaMemory.open() if info.backend == "cuda" else None  # the driver's pool, beside MLX
        self._idle_cache_bytes = next((b for b in (config.idle_cache_bytes, config.cache_limit_bytes) if b is not None),
                                      device_memory_bytes()[0] // 20)

    @property
    def draft(self) -> DraftInfo | None:
        return self.scoring.draft

    @property
    def has_work(self) -> bool:
        return bool(self._rows)

    # -- commands (between steps) -------------------------------------------------------------
    def apply(self, command: Told | Asked[Any]) -> Any:
        """One command of the protocol (`protocol.py`); what it answers."""
        match command:
            case AddRow(rid=rid, req=req):
                return self.add(rid, req)
            case CancelRow(rid=rid):
                return self.cancel(rid)
            case FreeSnapshotHandles(handles=handles, release_memory=release):
                return self.free_snapshots(handles, release)
            case FreeFeatureHashes(hashes=hashes):
                return self.free_features(hashes)
            case RunWarmup():
                return self.warmup()
            case ReadStats():
                return self.stats()
            case ResetPeakMemory():
                peak = mx.get_peak_memory()
                mx.reset_peak_memory()
                return peak
            case CloseEngine():
                return self.close()
            case CopySnapshotOut(handle=handle, metadata=metadata, free_after=free_after):
                return self.encode_snapshot(handle, metadata, free_after)
            case LoadSnapshotFile(path=path, length=length):
                return self.load_snapshot(path, length)
        raise TypeError(f"the engine core does not apply {type(command).__name__}")

    def add(self, rid: int, req: Generate) -> None:
        row = Row(rid=rid, req=req, detok=IncrementalDetokenizer(self._tokenizer.backend_tokenizer, self._vocab_size),
                  stops=StopMatcher(req.sampling.stop), sparse=req.sparse, specprefill=req.specprefill)
        self._rows[rid] = row
        self.scheduler.add(row)

    def cancel(self, rid: int) -> None:
        row = self._rows.pop(rid, None)
        if row is None:
            return
        self.scheduler.remove(rid)
        self.scoring.cancel(rid)
        if row.lane is not None:
            self.lanes[row.lane].remove(rid)

    def free_snapshots(self, handles: list[int], release_memory: bool = False) -> int:
        """Drop snapshots; `release_memory` (a flush) also returns MLX's freed buffers to the system."""
        freed = self.snapshots.free(handles)
        if release_memory:
            mx.clear_cache()
            release_freed_memory(collect=False)
        return freed

    def snapshot_layout(self) -> CacheLayout:
        """The live model's cache layout (and its MTP head's): what a snapshot file must fit."""
        if self._layout is None and isinstance(kv := self.lanes["plain"], KVLane):
            self._layout = kv.cache_layout()
        if self._layout is None:
            mtp = self.lanes.get("mtp")
            self._layout = probe_layout(self._model.language_model, mtp.head if isinstance(mtp, MTPLane) else None)
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
        snap = decode(source, length, self.snapshot_layout())
        return self.snapshots.add(snap), snap.nbytes

    def free_features(self, hashes: list[str]) -> None:
        self.features.free(hashes)

    def close(self) -> StepOutput:
        """End every request (the engine is shutting down) and drop all device state."""
        for row in list(self._rows.values()):
            self._drop(row, GenerationFailed("the engine is shutting down"))
        for lane in self.lanes.values():
            lane.clear()
        if isinstance(lib := self.lanes.get("library"), LibraryLane):
            lib.close()
        self.scoring.clear()
        self.snapshots.clear()
        self.features.clear()
        return StepOutput(self.output.take())

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> StepOutput:
        out = StepOutput()
        plan = self.scheduler.schedule()
        executed = self._execute(plan, out)
        self._update(executed, out)
        out.events = self.output.take()
        if not self.has_work:
            self._release_idle_memory()
        return out

    def _release_idle_memory(self) -> None:
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

    def _execute(self, plan: StepPlan, out: StepOutput) -> _Executed:
        executed = _Executed()
        for row in plan.to_score:
            self.scoring.add(row)
        if (scored := self.scoring.step()) is not None:
            row, outcome = scored
            out.scored.append(outcome)
            self.scheduler.add(row, first=True)
        for row in plan.joins:
            try:
                self._join(row, out)
            except BaseException as exc:
                if not is_failure(exc):  # native panics are failures too; control flow is not
                    raise
                log.exception("request %s could not join the batch", row.req.request_id)
                executed.failed.append((row, GenerationFailed("could not start the generation")))
        shares = self._prefill_shares()
        for name, lane in self.lanes.items():
            if not lane.has_work:
                continue
            try:
                executed.steps.append(lane.step(shares.get(name)))
            except BaseException as exc:
                if not is_failure(exc):  # native panics are failures too; control flow is not
                    raise
                log.exception("%s lane step failed; failing its rows", name)
                executed.failed += [(row, GenerationFailed("the batched decode step failed"))
                                    for row in self.scheduler.running.values() if row.lane == name]
                lane.clear()
        return executed

    def _prefill_shares(self) -> dict[LaneName, int]:
        """Each lane's prefill tokens this step: the budget less every lane's decoding tokens,
        split over the lanes by the rows each has prefilling (`token_budget.py`)."""
        lanes = [(name, lane) for name, lane in self.lanes.items() if lane.has_work]
        decode = sum(lane.decode_tokens for _, lane in lanes)
        budget = prefill_budget(self.token_budget, decode)
        split = split_by_rows([lane.prefilling for _, lane in lanes], budget)
        return {name: share for (name, _), share in zip(lanes, split, strict=True)}

    def _update(self, executed: _Executed, out: StepOutput) -> None:
        for row, error in executed.failed:
            self._drop(row, error)
        endings: list[Ending] = []
        for lane_step in executed.steps:
            totals = self._mtp_totals
            totals[0] += lane_step.mtp_rounds
            totals[1] += lane_step.mtp_drafted
            totals[2] += lane_step.mtp_accepted
            totals[3] += lane_step.mtp_fallback_rounds
            self.prefill_tokens += lane_step.prefill_tokens
            if lane_step.prefill_rows:
                self._prefill_totals[0] += 1
                self._prefill_totals[1] += lane_step.prefill_rows
            for rid, snap in lane_step.snapshots:
                if (row := self._rows.get(rid)) is not None:
                    out.snapshots.append(self._keep(row, snap, "system"))
            for tokens in lane_step.tokens:
                row = self._rows.get(tokens.rid)
                if row is not None and (ending := self.output.tokens(row, tokens)) is not None:
                    endings.append(ending)
        for ending in endings:
            self._end(ending, out)
        for row in self.scheduler.running.values():
            self.output.release(row)

    # -- execute: a row joins its lane --------------------------------------------------------
    def _join(self, row: Row, out: StepOutput) -> None:
        req = row.req
        assert row.lane is not None
        lane = self.lanes[row.lane]
        restore, snapshot_at = self._restore(req.prefix)
        spec = RowSpec(rid=row.rid, prompt=list(req.prompt_tokens), max_tokens=req.sampling.max_tokens,
                       restore=restore, snapshot_at=snapshot_at)
        if row.lane == "mtp":
            assert req.mtp_block is not None
            spec.sampler, spec.block_size = self.chains.sampler(req.sampling), req.mtp_block
        else:
            chain = self.chains.build(req.sampling)
            spec.processors, row.recorder, row.grammar = chain.processors, chain.recorder, chain.grammar
        if req.vision is not None:
            kwargs, encoded = self.features.prompt_kwargs(self._model, spec.prompt, req.vision)
            if encoded:
                out.features.append(FeaturesEncoded(req.request_id, encoded))
            if row.lane == "library":
                spec.prompt_kwargs = kwargs
            else:
                deltas = kwargs.get("rope_deltas")
                spec.embeds, spec.positions = kwargs["inputs_embeds"], kwargs.get("position_ids")
                spec.rope_delta = int(deltas.reshape(-1)[0].item()) if deltas is not None else 0
        elif row.sparse is not None:
            spec.prompt, kw, spec.snapshot_at = sparse_row(spec.prompt, row.sparse,
                                                           restore.length if restore else 0, snapshot_at)
            spec.positions, spec.rope_delta = kw["positions"], kw["rope_delta"]
        lane.add(spec)

    def _restore(self, plan: PrefixPlan | None) -> tuple[Snapshot | None, list[int]]:
        if plan is None:
            return None, []
        snap = None
        if plan.restore is not None:
            try:
                snap = self.snapshots.get(plan.restore)
            except KeyError:
                log.warning("snapshot %s is gone; prefilling from scratch", plan.restore)
        return snap, list(plan.snapshot_at)

    # -- update: rows end ---------------------------------------------------------------------
    def _end(self, ending: Ending, out: StepOutput) -> None:
        row = ending.row
        if ending.reason is None:
            assert ending.error is not None
            self._drop(row, ending.error)
            return
        assert row.lane is not None
        lane = self.lanes[row.lane]
        counts = RowCounts(cached_tokens=lane.cached_tokens(row.rid))
        if isinstance(lane, MTPLane):
            counts.mtp_drafted, counts.mtp_accepted = lane.drafts(row.rid)
            out.mtp.append(MTPOutcome(counts.mtp_drafted, counts.mtp_accepted))
        if ending.whole_step and (turn := self._turn_snapshot(row, lane)) is not None:
            out.snapshots.append(turn)
        lane.remove(row.rid)
        self.scheduler.remove(row.rid)
        del self._rows[row.rid]
        self.output.finish(row, ending.reason, counts)

    def _turn_snapshot(self, row: Row, lane: Lane) -> SnapshotTaken | None:
        """At a normal end: the row's whole state (prompt + reply) for the conversation's next turn."""
        plan = row.req.prefix
        if plan is None or not plan.snapshot_turn or row.sparse is not None:
            return None  # a sparse prefill's state is not the prompt's exact state
        try:
            snap = lane.extract(row.rid)
            if snap is None or snap.length <= len(row.req.prompt_tokens):
                return None
            return self._keep(row, snap, "turn", row.emitted_ids[:snap.length - len(row.req.prompt_tokens)])
        except Exception:
            log.exception("turn snapshot of %s failed", row.req.request_id)
            return None

    def _keep(self, row: Row, snap: Snapshot, kind: str, generated: list[int] | None = None) -> SnapshotTaken:
        handle = self.snapshots.add(snap)
        return SnapshotTaken(row.req.request_id, handle, snap.length, snap.nbytes, kind,  # type: ignore[arg-type]
                             generated or [])

    def _drop(self, row: Row, error: Exception) -> None:
        """The row ends with `error`: out of its lane and the scheduler, its stream fails."""
        self._rows.pop(row.rid, None)
        self.scheduler.remove(row.rid)
        self.scoring.cancel(row.rid)
        if row.lane is not None:
            try:
                self.lanes[row.lane].remove(row.rid)
            except Exception:
                log.exception("could not remove row %s", row.rid)
        self.output.fail(row, error)

    # -- warm-up and stats ----------------------------------------------------------------------
    def warmup(self) -> WarmupReport:
        """Compile the kernels the server uses: prefill and decode, greedy and sampled, batch 1
        and 2, then the plain lane's prefill at every (rows, chunk length) shape it runs at (fixed
        shapes; none with exact shapes) and its decode step at every batch size it runs at (up to
        max_num_seqs) and the compiled MTP round at every batch size its cohort runs at (up to
        mtp_max_batch); then measure what an MTP round costs in plain steps. Runs to completion on
        the calling (GPU) thread before traffic."""
        tic = time.perf_counter()
        prompt = list(range(1, min(64, self._vocab_size - 1)))
        greedy = SamplingParams(max_tokens=8)
        sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=0, max_tokens=8)
        mtp_block = self.scheduler.mtp_block
        for wave, batch in enumerate(([greedy], [greedy, sampled])):
            for j, params in enumerate(batch):
                self.add(-(2 * wave + j + 1), Generate(f"warmup-{wave}-{j}", prompt, params, mtp_block=mtp_block))
            while self.has_work:
                self.step()
        if isinstance(plain := self.lanes["plain"], PlainLane):  # the KV lane traces nothing ahead
            shapes = plain.warm_prefill(self._vocab_size, lambda rows, n, seconds: log.info(
                "warm-up: prefill of %d row(s) x %d tokens took %.2fs", rows, n, seconds))
            sizes = plain.warm_decode(self.config.max_num_seqs)
            log.info("prefill run at %d chunk shapes, decode step traced at %d batch sizes", shapes, sizes)
        if isinstance(mtp := self.lanes.get("mtp"), MTPLane):
            rounds = mtp.warm_rounds(min(self.config.mtp_max_batch, self.config.max_num_seqs))
            log.info("compiled MTP round traced at %d batch sizes", rounds)
        cost = self._mtp_round_cost(prompt) if "mtp" in self.lanes else None
        mx.clear_cache()  # the warm-up's buffers, dozens of shapes of them
        return WarmupReport(time.perf_counter() - tic, cost)

    def _mtp_round_cost(self, prompt: list[int], tokens: int = 32) -> float | None:
        """Seconds per MTP round over seconds per plain decode step, a lone greedy row each way,
        timed from its first token on (kernels already compiled). None if a row ended too soon
        to tell."""
        per_unit = []
        for mtp_block in (self.scheduler.mtp_block, None):
            self.add(-99, Generate("calibrate", prompt, SamplingParams(max_tokens=tokens), mtp_block=mtp_block))
            started, units, rounds0, tic = False, 0, 0, 0.0
            while self.has_work:
                out = self.step()
                if started:
                    units += 1
                elif any(isinstance(ev, TokenDelta) for _, ev in out.events):
                    started, rounds0, tic = True, self._mtp_totals[0], time.perf_counter()
            elapsed = time.perf_counter() - tic
            if mtp_block is not None:
                units = self._mtp_totals[0] - rounds0
            if units < 4:
                return None
            per_unit.append(elapsed / units)
        return per_unit[0] / per_unit[1]

    def stats(self) -> EngineStats:
        rounds, drafted, accepted, fallback = self._mtp_totals
        mtp = self.lanes.get("mtp")
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           scoring=len(self.scoring), mtp_running=len(mtp) if mtp is not None else 0,
                           mtp_rounds=rounds, mtp_drafted=drafted, mtp_accepted=accepted,
                           mtp_fallback_rounds=fallback,
                           snapshots=len(self.snapshots), snapshot_bytes=self.snapshots.bytes,
                           features=len(self.features), feature_bytes=self.features.bytes,
                           prefill_chunks=self._prefill_totals[0], prefill_rows=self._prefill_totals[1],
                           active_memory_bytes=mx.get_active_memory(), cache_memory_bytes=mx.get_cache_memory(),
                           peak_memory_bytes=mx.get_peak_memory(), **self._cuda_stats())

    def _cuda_stats(self) -> dict[str, int]:
        if self._cuda is None:
            return {}
        pool = self._cuda.read()
        return {"cuda_pool_reserved_bytes": pool.reserved, "cuda_pool_used_bytes": pool.used,
                "cuda_pool_reserved_high_bytes": pool.reserved_high,
                **({"device_used_bytes": pool.device_used} if pool.device_used is not None else {})}


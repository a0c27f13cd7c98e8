"""The engine core: one step is schedule -> execute -> update (GPU thread only).

    plan = scheduler.schedule()      # StepPlan: which rows join which lane, which are scored
    executed = self._execute(plan)   # rows start in their lanes; each lane steps once within the
                                     # step's token budget (scheduling/token_budget.py: decodes first); a draft chunk
    return self._update(executed)    # output stage: text, stops, endings; rows leave their lanes

vLLM v1's `EngineCore.step` and nano-vllm's `step` have this shape. The pieces, one module each:
`scheduler.py` (queue, slots, lane routing), the lanes behind `lane.Lane` (`engine/lane_set.py`
says which run), `scoring/stage.py` (SpecPrefill's draft, where it lives), `output.py`
(detokenizing, stop strings, finishing), `logits.py` (each row's processor chain),
`memory/held.py` (prefix-cache snapshots and image features behind handles, their file bytes,
the memory counters and the idle release), `warmup.py` (the warm-up and the MTP calibration).

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

from mlx_relay.config import EngineConfig
from mlx_relay.engine.embeddings.embedder import Embedder
from mlx_relay.engine.embeddings.jobs import EmbeddingJobs
from mlx_relay.engine.lane import Lane, LaneStep, MTPCounts
from mlx_relay.engine.lane_set import build_lanes, prefill_step_size, speculative_draft
from mlx_relay.engine.memory.held import HeldMemory
from mlx_relay.engine.memory.kv_budget import engine_plan, with_held_weights
from mlx_relay.engine.memory.snapshot_codec import CacheLayout
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.models import UnsupportedModel
from mlx_relay.engine.models.library_kv import uses_library_forward
from mlx_relay.engine.models.loader import LoadedModel, device_memory_bytes
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.protocol import (
    AddEmbedding,
    AddRow,
    Asked,
    CancelRow,
    CloseEngine,
    CopySnapshotOut,
    Event,
    FreeFeatureHashes,
    FreeSnapshotHandles,
    LoadSnapshotFile,
    ReadStats,
    ResetPeakMemory,
    RunWarmup,
    StepOutput,
    Told,
)
from mlx_relay.engine.scheduling.token_budget import MIN_PREFILL_TOKENS, step_budget
from mlx_relay.engine.scoring.stage import ScoringStage
from mlx_relay.engine.step.detokenizer import IncrementalDetokenizer, StopMatcher
from mlx_relay.engine.step.interleave import decode_priority
from mlx_relay.engine.step.join import row_spec
from mlx_relay.engine.step.logits import LogitsChains
from mlx_relay.engine.step.output import OutputStage, RowCounts, RowEnd
from mlx_relay.engine.step.prefill_shares import PrefillShares
from mlx_relay.engine.step.rows import Row
from mlx_relay.engine.step.scheduler import Scheduler, StepPlan
from mlx_relay.engine.step.warmup import warm_up
from mlx_relay.errors import GenerationFailed
from mlx_relay.messages.gpu import DraftInfo, Drafts, EngineStats, Generate, WarmupReport
from mlx_relay.messages.prefix_cache import PrefixPlan, SnapshotTaken
from mlx_relay.messages.specprefill import ScoringOutcome
from mlx_relay.messages.text_mtp import MTPOutcome
from mlx_relay.messages.vision import FeaturesEncoded
from mlx_relay.runtime.supervision import is_failure

log = logging.getLogger(__name__)


@dataclass
class _Executed:
    """What the execute stage did: each lane's step, the rows that failed, and what it tells the
    policy actors (a scoring outcome, the features joining rows encoded)."""

    steps: list[LaneStep] = field(default_factory=list)
    failed: list[tuple[Row, Exception]] = field(default_factory=list)
    scored: list[ScoringOutcome] = field(default_factory=list)
    features: list[FeaturesEncoded] = field(default_factory=list)
    embedded_tokens: int = 0  # an embedding request's batch: its padded tokens
    embedded: list[tuple[int, Event]] = field(default_factory=list)  # (rid, vectors) of the finished requests


@dataclass
class _Updated:
    """What the update stage leaves for the policy actors: snapshots taken, ended rows' MTP counts."""

    snapshots: list[SnapshotTaken] = field(default_factory=list)
    mtp: list[MTPOutcome] = field(default_factory=list)


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, *, prefix_cache: bool,
                 draft_model: str | None = None, stage: Stage | None = None) -> None:
        self.config = config
        self._model = loaded.model
        # an embedding model beside the chat model (`--embedding-model`), loaded before the rows'
        # memory is planned so that its weights are counted
        self.embeddings = EmbeddingJobs(Embedder.load(Path(config.embedding_model)) if config.embedding_model else None)
        info = loaded.info
        tok = loaded.processor.tokenizer if hasattr(loaded.processor, "tokenizer") else loaded.processor
        self._tokenizer = tok
        self.vocab_size = info.vocab_size
        # the longest prefill chunk, within what one forward can run on this backend (`engine/lane_set.py`)
        step = prefill_step_size(loaded.model.language_model, config, info.backend)
        # the step's token budget: decoding rows first, prefill chunks in what is left; while rows
        # decode, prefill within a share of the time (`interleave.py`; None: off). Off in a
        # pipeline: every rank must take the same steps, and each would time its own
        token_budget = step_budget(config.max_num_batched_tokens, step, info.backend,
                                   config.max_num_seqs * max(1, config.mtp_block_size))
        self.shares = PrefillShares(token_budget, decode_priority(
            config.decode_stall_factor, info.backend, MIN_PREFILL_TOKENS) if stage is None else None)
        # the rows' caches within the device's memory, the prefill's working set bounded from it
        # (`memory/kv_budget.py`; not counted on a pipeline stage, whose ranks hold different layers)
        budget, prefill_options = engine_plan(loaded, config, prefix_cache=prefix_cache, chunk_tokens=step)
        self.lanes = build_lanes(loaded, config, token_budget=token_budget,
                                 stage=stage, step=step, prefill_options=prefill_options)
        self.kv_budget = with_held_weights(budget) if stage is None else None
        self.scheduler = Scheduler(max_num_seqs=config.max_num_seqs,
                                   mtp_block=config.mtp_block_size if "mtp" in self.lanes else None,
                                   mtp_max_batch=config.mtp_max_batch,
                                   budget=self.kv_budget,
                                   sole="kv" if "kv" in self.lanes else None)
        if draft_model is not None and uses_library_forward(loaded.model.language_model):
            raise UnsupportedModel(f"SpecPrefill needs a model family of the engine's own "
                                   f"({info.model_type} is served through its library's forward)")
        # the draft (a much smaller model) reads at most a budget's worth of a prompt per step
        self.scoring = ScoringStage(draft_model, tok, min(step, token_budget))
        self.output = OutputStage()
        self.chains = LogitsChains(tok, info.vocab_size, info.eos_token_ids, config.seed)
        # snapshots, features, memory; what MLX may keep cached while idle (EngineConfig.idle_cache_bytes)
        self.memory = HeldMemory(cuda=info.backend == "cuda", probe_layout=self._probe_layout,
                                 idle_cache_bytes=next((b for b in (config.idle_cache_bytes, config.cache_limit_bytes)
                                                        if b is not None), device_memory_bytes()[0] // 20))
        self.snapshots, self.features = self.memory.snapshots, self.memory.features
        self._rows: dict[int, Row] = {}  # every row the engine holds, by id
        self.mtp_totals = MTPCounts()
        self.prefill_chunks = 0  # steps whose prefill ran
        self.prefill_rows = 0  # rows over those chunks
        self.mixed_steps = 0  # chunks whose forward carried decoding rows too
        self.prefill_tokens = 0  # prompt tokens the lanes' prefill ran, padding included (all steps)

    @property
    def draft(self) -> DraftInfo | None:
        return self.scoring.draft

    @property
    def speculative_draft(self) -> str | None:
        """The draft model the MTP lane verifies drafts of, when one is loaded."""
        return speculative_draft(self.lanes)

    @property
    def has_work(self) -> bool:
        return bool(self._rows) or self.embeddings.has_work

    # -- commands (between steps) -------------------------------------------------------------
    def apply(self, command: Told | Asked[Any]) -> Any:
        """One command of the protocol (`protocol.py`); what it answers."""
        match command:
            case AddRow(rid=rid, req=req):
                return self.add(rid, req)
            case CancelRow(rid=rid):
                return self.cancel(rid)
            case FreeSnapshotHandles(handles=handles, release_memory=release):
                return self.memory.free_snapshots(handles, release)
            case FreeFeatureHashes(hashes=hashes):
                return self.features.free(hashes)
            case RunWarmup():
                return self.warmup()
            case ReadStats():
                return self.stats()
            case ResetPeakMemory():
                return self.memory.reset_peak()
            case CloseEngine():
                return self.close()
            case CopySnapshotOut(handle=handle, metadata=metadata, free_after=free_after):
                return self.memory.encode_snapshot(handle, metadata, free_after)
            case LoadSnapshotFile(path=path, length=length):
                return self.memory.load_snapshot(path, length)
            case AddEmbedding(rid=rid, inputs=inputs):
                return self.embeddings.add(rid, inputs)
        raise TypeError(f"the engine core does not apply {type(command).__name__}")

    def add(self, rid: int, req: Generate) -> None:
        row = Row(rid=rid, req=req, detok=IncrementalDetokenizer(self._tokenizer.backend_tokenizer, self.vocab_size),
                  stops=StopMatcher(req.sampling.stop), sparse=req.sparse, specprefill=req.specprefill)
        self._rows[rid] = row
        self.scheduler.add(row)

    def cancel(self, rid: int) -> None:
        self.embeddings.cancel(rid)
        row = self._rows.pop(rid, None)
        if row is None:
            return
        self.scheduler.remove(rid)
        self.scoring.cancel(rid)
        if row.lane is not None:
            self.lanes[row.lane].remove(rid)

    def snapshot_layout(self) -> CacheLayout:
        """The live model's cache layout (and its MTP head's): what a snapshot file must fit."""
        return self.memory.layout()

    def _probe_layout(self) -> CacheLayout:
        """The MTP lane's layout (its head's included) where it runs, else the plain (or KV) lane's."""
        layout = next(self.lanes[n] for n in ("mtp", "plain", "kv") if n in self.lanes).cache_layout()
        assert layout is not None  # (the plain, MTP and KV lanes take snapshots)
        return layout

    def close(self) -> StepOutput:
        """End every request (the engine is shutting down) and drop all device state."""
        for row in list(self._rows.values()):
            self._drop(row, GenerationFailed("the engine is shutting down"))
        for lane in self.lanes.values():
            lane.clear()
            lane.close()
        self.scoring.clear()
        self.memory.clear()
        return StepOutput(self.output.take())

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> StepOutput:
        plan = self.scheduler.schedule()
        tic = time.perf_counter()
        executed = self._execute(plan)
        self.shares.observe(time.perf_counter() - tic, executed.embedded_tokens
                            + sum(s.prefill_tokens for s in executed.steps))
        updated = self._update(executed)
        out = StepOutput(events=self.output.take() + executed.embedded, snapshots=updated.snapshots,
                         scored=executed.scored, features=executed.features, mtp=updated.mtp)
        if not self.has_work:
            self.memory.release_idle()
        return out

    def _execute(self, plan: StepPlan) -> _Executed:
        executed = _Executed()
        for row in plan.to_score:
            self.scoring.add(row)
        if (scored := self.scoring.step()) is not None:
            row, outcome = scored
            executed.scored.append(outcome)
            self.scheduler.add(row, first=True)
        for row in plan.joins:
            try:
                if (encoded := self._join(row)) is not None:
                    executed.features.append(encoded)
            except BaseException as exc:
                if not is_failure(exc):  # native panics are failures too; control flow is not
                    raise
                log.exception("request %s could not join the batch", row.req.request_id)
                executed.failed.append((row, GenerationFailed("could not start the generation")))
        shares = self._prefill_shares()
        # an embedding request's batch, within the prefill's share
        executed.embedded_tokens, executed.embedded = self.embeddings.run(shares.pop("embeddings", 0))
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

    def _prefill_shares(self) -> dict[str, int]:
        """Each working lane's prefill tokens this step (`prefill_shares.py`), and the embedding
        requests' ("embeddings": one more prompt prefilling)."""
        lanes = [(name, lane) for name, lane in self.lanes.items() if lane.has_work]
        embeds = self.embeddings.has_work
        names = [name for name, _ in lanes] + (["embeddings"] if embeds else [])
        split = self.shares.split(sum(lane.decode_tokens for _, lane in lanes),
                                  [lane.prefilling for _, lane in lanes] + ([1] if embeds else []),
                                  lambda: [lane.finishing_costs for _, lane in lanes] + ([[]] if embeds else []))
        return dict(zip(names, split, strict=True))

    def _update(self, executed: _Executed) -> _Updated:
        updated = _Updated()
        for row, error in executed.failed:
            self._drop(row, error)
        endings: list[RowEnd] = []
        for lane_step in executed.steps:
            self.mtp_totals.add(lane_step.mtp)
            self.prefill_tokens += lane_step.prefill_tokens
            if lane_step.prefill_rows:
                self.prefill_chunks += 1
                self.prefill_rows += lane_step.prefill_rows
                self.mixed_steps += lane_step.mixed
            for rid, snap in lane_step.snapshots:
                if (row := self._rows.get(rid)) is not None:
                    updated.snapshots.append(self._keep(row, snap, "system"))
            for tokens in lane_step.tokens:
                row = self._rows.get(tokens.rid)
                if row is not None and (ending := self.output.tokens(row, tokens)) is not None:
                    endings.append(ending)
        for ending in endings:
            self._end(ending, updated)
        for row in self.scheduler.running.values():
            self.output.release(row)
        return updated

    # -- execute: a row joins its lane --------------------------------------------------------
    def _join(self, row: Row) -> FeaturesEncoded | None:
        """The row starts in its lane (`join.py`); the image features it encoded, if any."""
        assert row.lane is not None
        restore, snapshot_at = self._restore(row.req.prefix)
        spec, encoded = row_spec(row, restore, snapshot_at, self.chains, self.features, self._model)
        self.lanes[row.lane].add(spec)
        return encoded

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
    def _end(self, ending: RowEnd, updated: _Updated) -> None:
        row = ending.row
        if ending.reason is None:
            assert ending.error is not None
            self._drop(row, ending.error)
            return
        assert row.lane is not None
        lane = self.lanes[row.lane]
        counts = RowCounts(cached_tokens=lane.cached_tokens(row.rid))
        if (drafts := lane.drafts(row.rid)) is not None:  # a lane that speculates
            counts.drafts = Drafts.of(drafts)
            updated.mtp.append(MTPOutcome(counts.drafts))
        if ending.whole_step and (turn := self._turn_snapshot(row, lane)) is not None:
            updated.snapshots.append(turn)
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
        """Compile the kernels the server uses and calibrate MTP (`warmup.py`)."""
        return warm_up(self)

    def stats(self) -> EngineStats:
        mtp, totals = self.lanes.get("mtp"), self.mtp_totals
        return EngineStats(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                           scoring=len(self.scoring), mtp_running=len(mtp) if mtp is not None else 0,
                           mtp_rounds=totals.rounds, mtp_drafted=totals.drafted, mtp_accepted=totals.accepted,
                           mtp_fallback_rounds=totals.fallback_rounds,
                           context_drafted=totals.context_drafted, context_accepted=totals.context_accepted,
                           draft_drafted=totals.draft_drafted, draft_accepted=totals.draft_accepted,
                           wide_rounds=totals.wide_rounds, pipelined_rounds=totals.pipelined_rounds,
                           prefill_chunks=self.prefill_chunks, prefill_rows=self.prefill_rows,
                           mixed_steps=self.mixed_steps, **self.memory.stats())

"""Continuous batching over mlx-vlm's `BatchGenerator` (runs on the GPU thread only).

One step is schedule, execute, update (vLLM v1's shape):
- schedule: move waiting sequences into the generator while fewer than `max_num_seqs` run;
  each gets its prompt embeddings and, if it samples, its own `RowSampler`;
- execute: one `BatchGenerator.next()` (a decode step for the running rows, then at most one
  prefill chunk for the joining ones), and one MTP round for the text rows of the MTP lane
  (`mtp_lane.MTPLane`, plus at most one prefill chunk of a joining text row);
- update: detokenize each new token, match stop strings, finish rows, and post the step's
  events to the event loop in one call.

Routing: text-only requests go to the MTP lane when the checkpoint has an MTP head, the request
did not opt out and fewer than `mtp_max_batch` rows are running when it starts; everything else
(images, video, opt-outs, a busy engine) goes to the plain batch. Both lanes share the same language-model
weights and run in the same step. SpecPrefill rows (a sparse selection of their prompt) always
prefill in our own plain lane, which feeds the kept tokens at their original positions.

SpecPrefill's draft scoring runs here too, one draft chunk of one job per step, so a long
prompt being scored never holds the running rows for more than a chunk.

A request that fails on its own (embedding, insertion, detokenization) ends with an error and
the batch goes on. If the batched step itself fails, the rows in it end with an error and a
fresh generator serves the next requests.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_vlm.generate.ar import BatchGenerator

from mlx_relay.chat.output import TokenLogprob
from mlx_relay.engine.detokenizer import IncrementalDetokenizer, StopMatcher
from mlx_relay.engine.draft_scorer import DraftScorer, ScoringFailed, ScoringJob
from mlx_relay.engine.loader import LoadedModel
from mlx_relay.engine.messages import (
    DraftInfo,
    EngineStats,
    Finished,
    Generate,
    PrefixPlan,
    PromptScored,
    SamplingParams,
    ScorePrompt,
    SnapshotTaken,
    TokenDelta,
)
from mlx_relay.engine.mtp_head import MTPHead
from mlx_relay.engine.mtp_lane import MTPLane, MTPRow
from mlx_relay.engine.plain_lane import PlainLane, PlainRow
from mlx_relay.engine.processors import GrammarMask, LogprobRecorder, Penalties, ThinkingBudget
from mlx_relay.engine.row_prefill import sparse_row
from mlx_relay.engine.sampling import RowSampler, needs_sampler
from mlx_relay.engine.snapshots import Snapshot, SnapshotPool
from mlx_relay.engine.vision import FeatureCache, vision_prompt_kwargs
from mlx_relay.errors import GenerationFailed, InvalidRequest
from mlx_relay.memory import release_freed_memory
from mlx_relay.runtime.supervision import is_failure

log = logging.getLogger(__name__)

# (stream id, event); an event is a TokenDelta, a Finished or an exception for that stream, a
# SnapshotTaken for the prefix cache or a PromptScored for the SpecPrefillScorer (neither is part
# of a stream).
Event = tuple[int, TokenDelta | Finished | SnapshotTaken | PromptScored | BaseException]


@dataclass
class _Seq:
    sid: int
    req: Generate
    detok: IncrementalDetokenizer
    stops: StopMatcher
    arrived: float
    uid: int | None = None
    mtp: MTPRow | None = None  # set when the row decodes in the MTP lane
    plain: PlainRow | None = None  # set when the row decodes in our plain lane (prefix cache on)
    generated: int = 0
    first_token_at: float | None = None
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    emitted_ids: list[int] = field(default_factory=list)
    recorder: LogprobRecorder | None = None  # when the request asked for logprobs
    grammar: GrammarMask | None = None  # when the request has a grammar
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


class BatchEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_num_seqs: int,
        prefill_batch_size: int,
        prefill_step_size: int,
        seed: int,
        emit: Callable[[list[Event]], None],
        vision_cache_bytes: int = 512 * 1024 * 1024,
        mtp: bool = True,
        mtp_block_size: int = 2,
        mtp_max_batch: int = 2,  # as EngineConfig
        mtp_verify: str = "auto",  # as EngineConfig
        prefix_cache: bool = False,  # own prefill for every row: restorable, snapshottable
    ) -> None:
        self._loaded = loaded
        self._model = loaded.model
        self._processor = loaded.processor
        tok = loaded.processor.tokenizer if hasattr(loaded.processor, "tokenizer") else loaded.processor
        self._tokenizer = tok
        self._rust_tokenizer = tok.backend_tokenizer
        self._vocab_size = loaded.info.vocab_size
        self._max_num_seqs = max_num_seqs
        self._prefill_batch_size = min(prefill_batch_size, max_num_seqs)
        self._prefill_step_size = prefill_step_size
        self._emit = emit
        self._seeds = random.Random(seed)
        self._waiting: deque[_Seq] = deque()
        self._by_sid: dict[int, _Seq] = {}
        self._by_uid: dict[int, _Seq] = {}
        self._events: list[Event] = []
        self._features = FeatureCache(vision_cache_bytes)
        self._gen = self._new_generator()
        self._mtp_max_batch = mtp_max_batch
        self._mtp: MTPLane | None = None
        if mtp and loaded.info.has_mtp and mtp_max_batch > 0:
            exact = mtp_verify == "exact" or (mtp_verify == "auto" and loaded.info.backend == "metal")
            head = MTPHead.load(Path(loaded.info.model_path), self._model.language_model, exact=exact)
            self._mtp = MTPLane(self._model.language_model, head, block_size=mtp_block_size,
                                prefill_step_size=prefill_step_size, eos_token_ids=loaded.info.eos_token_ids,
                                exact_verify=exact)
        self._next_mtp_uid = 1 << 48  # MTP rows get uids far from the generator's
        self._snapshots = SnapshotPool()
        self._plain: PlainLane | None = None
        self._own_prefill = prefix_cache  # every non-MTP row prefills in our plain lane
        if prefix_cache:
            self._plain = PlainLane(self._model.language_model, prefill_step_size=prefill_step_size)
        self._draft: DraftScorer | None = None  # SpecPrefill's draft model, once loaded
        self._scoring: dict[str, tuple[ScoringJob, float]] = {}  # request id -> (job, started), FIFO
        self._mtp_totals = [0, 0, 0]  # rounds, drafted, accepted
        self._eos = frozenset(loaded.info.eos_token_ids)
        self._llg_tokenizer: Any = None  # built on the first request with a grammar
        vocab = tok.get_vocab()  # once: the thinking block's tags, if the tokenizer has them
        self._think: tuple[int | None, int | None] = (vocab.get("<think>"), vocab.get("</think>"))

    # -- lifecycle ---------------------------------------------------------------------------
    def _new_generator(self) -> BatchGenerator:
        # The generator admits new prompts only while `completion_batch_size - running` is at
        # least `prefill_batch_size`; we bound running rows ourselves, so give it that headroom
        # (pinned by tests/test_library_adapters.py).
        return BatchGenerator(
            self._model.language_model,
            self._processor,
            completion_batch_size=self._max_num_seqs + self._prefill_batch_size,
            prefill_batch_size=self._prefill_batch_size,
            prefill_step_size=self._prefill_step_size,
            compute_logprobs=False,
            greedy_sampling=True,
        )

    def close(self) -> None:
        for seq in list(self._by_sid.values()):
            self._finish_error(seq, GenerationFailed("the engine is shutting down"))
        self._flush()
        self._gen.close()
        if self._mtp is not None:
            self._mtp.clear()
        if self._plain is not None:
            self._plain.clear()
        for rid in list(self._scoring):
            self.cancel_scoring(rid)
        self._snapshots.clear()

    @property
    def mtp_enabled(self) -> bool:
        return self._mtp is not None

    @property
    def lane_models(self) -> tuple[Any, Any | None]:
        """The language model each path decodes with: (plain batch incl. vision, MTP text lane)."""
        return self._gen.model, (self._mtp.lm if self._mtp is not None else None)

    @property
    def mtp_head(self) -> MTPHead | None:
        return self._mtp.head if self._mtp is not None else None

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or bool(self._by_uid) or bool(self._scoring)

    @property
    def running(self) -> int:
        return len(self._by_uid)

    # -- commands (called through GPUThread.submit) ------------------------------------------
    def add(self, sid: int, req: Generate) -> None:
        bad = not req.prompt_tokens or not all(0 <= t < self._vocab_size for t in req.prompt_tokens)
        if bad:
            self._events.append((sid, InvalidRequest("the prompt is empty or has token ids outside the vocabulary")))
            self._flush()
            return
        seq = _Seq(
            sid=sid,
            req=req,
            detok=IncrementalDetokenizer(self._rust_tokenizer, self._vocab_size),
            stops=StopMatcher(req.sampling.stop),
            arrived=time.perf_counter(),
        )
        self._by_sid[sid] = seq
        self._waiting.append(seq)

    def cancel(self, sid: int) -> None:
        seq = self._by_sid.pop(sid, None)
        if seq is None:
            return
        if seq.uid is None:
            self._waiting = deque(s for s in self._waiting if s.sid != sid)
        else:
            self._by_uid.pop(seq.uid, None)
            self._remove_row(seq)

    def _remove_row(self, seq: _Seq) -> None:
        assert seq.uid is not None
        if seq.mtp is not None:
            assert self._mtp is not None
            self._mtp.remove(seq.uid)
        elif seq.plain is not None:
            assert self._plain is not None
            self._plain.remove(seq.uid)
        else:
            self._gen.remove(seq.uid)

    def warmup(self) -> float:
        """Compile the kernels the server uses: prefill and decode, greedy and sampled, batch 1
        and 2. Runs to completion on the calling (GPU) thread before traffic; returns seconds."""
        tic = time.perf_counter()
        prompt = list(range(1, min(64, self._vocab_size - 1)))
        greedy = SamplingParams(max_tokens=8)
        sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=0, max_tokens=8)
        emit, self._emit = self._emit, lambda _events: None
        try:
            for sid, batch in enumerate(([greedy], [greedy, sampled])):
                for j, params in enumerate(batch):
                    self.add(-(2 * sid + j + 1), Generate(f"warmup-{sid}-{j}", prompt, params))
                while self.has_work:
                    self.step()
        finally:
            self._emit = emit
        return time.perf_counter() - tic

    # -- SpecPrefill's draft scoring ---------------------------------------------------------------
    def load_draft(self, path: str) -> DraftInfo:
        """Load the draft model SpecPrefill scores prompts with (its tokenizer must be ours)."""
        self._draft = DraftScorer.load(Path(path), self._tokenizer)
        return self._draft.info

    def score(self, msg: ScorePrompt) -> None:
        """Queue a scoring job; its chunks run between steps, its outcome is a PromptScored event."""
        try:
            if self._draft is None:
                raise ScoringFailed("no SpecPrefill draft model is loaded")
            job = self._draft.start(msg.tokens, chunk=self._prefill_step_size, window=msg.window)
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            self._events.append((-1, PromptScored(msg.request_id, error=f"{type(exc).__name__}: {exc}")))
            self._flush()
            return
        self._scoring[msg.request_id] = (job, time.perf_counter())

    def cancel_scoring(self, request_id: str) -> None:
        entry = self._scoring.pop(request_id, None)
        if entry is not None:
            entry[0].close()

    def _score_step(self) -> None:
        """One draft chunk of the oldest scoring job (the others wait: one chunk per step)."""
        rid = next(iter(self._scoring))
        job, started = self._scoring[rid]
        try:
            scores = job.step()
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            log.warning("SpecPrefill scoring of %s failed: %s", rid, exc)
            del self._scoring[rid]
            job.close()
            self._events.append((-1, PromptScored(rid, error=f"{type(exc).__name__}: {exc}")))
            return
        if scores is not None:
            del self._scoring[rid]
            self._events.append((-1, PromptScored(rid, scores, time.perf_counter() - started)))

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> None:
        self._schedule()
        if self._scoring:
            self._score_step()
        if any(seq.mtp is None and seq.plain is None for seq in self._by_uid.values()):
            self._plain_step()
        if self._plain is not None and self._plain.has_work:
            self._own_plain_step(self._plain)
        if self._mtp is not None and self._mtp.has_work:
            self._mtp_step(self._mtp)
        for seq in self._by_uid.values():
            self._release_text(seq)
        self._flush()

    # -- prefix-cache snapshots ---------------------------------------------------------------------
    def free_snapshots(self, handles: list[int], release_memory: bool = False) -> int:
        """Drop snapshots; `release_memory` (a flush) also returns MLX's freed buffers to the system."""
        freed = self._snapshots.free(handles)
        if release_memory:
            mx.clear_cache()
            release_freed_memory(collect=False)
        return freed

    def _report_snapshots(self, seq: _Seq, snaps: list[Snapshot]) -> None:
        for snap in snaps:
            handle = self._snapshots.add(snap)
            self._events.append((seq.sid, SnapshotTaken(seq.req.request_id, handle, snap.length, snap.nbytes,
                                                        "system")))
        snaps.clear()

    def _turn_snapshot(self, seq: _Seq) -> None:
        """At a normal finish: the row's whole state (prompt + reply) for the conversation's next turn."""
        plan = seq.req.prefix
        if plan is None or not plan.snapshot_turn or seq.uid is None or seq.req.sparse is not None:
            return  # a sparse prefill's state is not the prompt's exact state
        try:
            if seq.mtp is not None and self._mtp is not None:
                if seq.mtp.emitted != seq.generated:  # finished inside a round: the state is past it
                    return
                snap = self._mtp.extract(seq.uid)
            elif seq.plain is not None and self._plain is not None:
                snap = self._plain.extract(seq.uid)
            else:
                return
            if snap is None or snap.length <= len(seq.req.prompt_tokens):
                return
            handle = self._snapshots.add(snap)
        except Exception:
            log.exception("turn snapshot of %s failed", seq.req.request_id)
            return
        generated = seq.emitted_ids[:snap.length - len(seq.req.prompt_tokens)]
        self._events.append((seq.sid, SnapshotTaken(seq.req.request_id, handle, snap.length, snap.nbytes, "turn",
                                                    generated)))

    def _restore(self, plan: PrefixPlan | None) -> tuple[Snapshot | None, list[int]]:
        if plan is None:
            return None, []
        snap = None
        if plan.restore is not None:
            try:
                snap = self._snapshots.get(plan.restore)
            except KeyError:
                log.warning("snapshot %s is gone; prefilling from scratch", plan.restore)
        return snap, list(plan.snapshot_at)

    def _own_plain_step(self, lane: PlainLane) -> None:
        try:
            out = lane.step()
            lane.prefill_step()
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            self._fail_rows([seq for seq in self._by_uid.values() if seq.plain is not None], exc, "plain lane")
            lane.clear()
            return
        for uid, token in out:
            seq = self._by_uid.get(uid)
            if seq is not None:
                self._on_lane_tokens(seq, [token])
        for seq in self._by_uid.values():
            if seq.plain is not None and seq.plain.snapshots:
                self._report_snapshots(seq, seq.plain.snapshots)

    def _fail_rows(self, rows: list[_Seq], exc: BaseException, what: str) -> None:
        """A lane's step failed: its rows end with an error; the other lanes go on."""
        log.exception("%s step failed; failing its %d rows", what, len(rows))
        for seq in rows:
            self._by_uid.pop(seq.uid, None)  # type: ignore[arg-type]
            self._finish_error(seq, GenerationFailed("the batched decode step failed"))

    def _plain_step(self) -> None:
        try:
            _, responses = self._gen.next()
        except BaseException as exc:  # the broken generator is dropped whole
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            self._fail_rows([seq for seq in self._by_uid.values() if seq.mtp is None and seq.plain is None], exc,
                            "batched")
            self._gen.close()
            self._gen = self._new_generator()
            return
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is not None:
                self._on_token(seq, r.token, r.finish_reason)

    def _mtp_step(self, lane: MTPLane) -> None:
        try:
            result = lane.round() if lane.rows else None
            joined = lane.prefill_step()
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            self._fail_rows([seq for seq in self._by_uid.values() if seq.mtp is not None], exc, "MTP")
            lane.clear()
            return
        if result is not None:
            totals = self._mtp_totals
            totals[0] += result.rounds
            totals[1] += result.drafted
            totals[2] += result.accepted
            for uid, tokens in result.tokens.items():
                seq = self._by_uid.get(uid)
                if seq is not None:
                    self._on_lane_tokens(seq, tokens)
        for seq in self._by_uid.values():
            if seq.mtp is not None and seq.mtp.snapshots:
                self._report_snapshots(seq, seq.mtp.snapshots)
        if joined is not None:
            seq = self._by_uid.get(joined[0].uid)
            if seq is not None:
                self._on_lane_tokens(seq, [joined[1]])

    def _on_lane_tokens(self, seq: _Seq, tokens: list[int]) -> None:
        """Tokens from one of our lanes, which leave finishing to the engine."""
        eos = self._eos
        for token in tokens:
            reason = "stop" if token in eos else "length" if seq.generated + 1 >= seq.req.sampling.max_tokens else None
            self._on_token(seq, token, reason)
            if seq.uid not in self._by_uid:
                return

    def _schedule(self) -> None:
        while self._waiting and len(self._by_uid) < self._max_num_seqs:
            seq = self._waiting.popleft()
            try:
                if self._takes_mtp(seq.req):
                    seq.uid = self._insert_mtp(seq)
                elif self._own_prefill or seq.req.sparse is not None:
                    seq.uid = self._insert_own_plain(seq)
                else:
                    seq.uid = self._insert(seq)
            except BaseException as exc:
                if not is_failure(exc):  # native panics are failures too; control flow is not
                    raise
                log.exception("request %s could not join the batch", seq.req.request_id)
                self._finish_error(seq, GenerationFailed("could not start the generation"))
                continue
            self._by_uid[seq.uid] = seq

    def stats(self) -> EngineStats:
        f = self._features.stats
        rounds, drafted, accepted = self._mtp_totals
        return EngineStats(running=len(self._by_uid), waiting=len(self._waiting), vision_cache_hits=f.hits,
                           vision_cache_misses=f.misses, vision_cache_entries=f.entries, vision_cache_bytes=f.bytes,
                           mtp_running=len(self._mtp) if self._mtp is not None else 0, mtp_rounds=rounds,
                           mtp_drafted=drafted, mtp_accepted=accepted, snapshots=len(self._snapshots),
                           snapshot_bytes=self._snapshots.bytes, scoring=len(self._scoring))

    def _sampler(self, params: SamplingParams) -> RowSampler | None:
        if not needs_sampler(params):
            return None
        return RowSampler(params, params.seed if params.seed is not None else self._seeds.getrandbits(63))

    def _processors(self, seq: _Seq) -> list[Any]:
        """The row's logits processors, in order (`engine/processors.py`); the sampler last."""
        p = seq.req.sampling
        chain: list[Any] = []
        if p.logprobs >= 0:
            seq.recorder = LogprobRecorder(p.logprobs, self._token_text)
            chain.append(seq.recorder)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty not in (None, 1.0):
            chain.append(Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty))
        think_start, think_end = self._think
        if p.thinking_budget is not None and think_end is not None:
            # a grammar that follows the thinking starts right after `</think>`
            close = "\n</think>" if p.grammar is not None else "\n</think>\n\n"
            ids = list(self._tokenizer.encode(close, add_special_tokens=False))
            chain.append(ThinkingBudget(p.thinking_budget, ids, think_end, think_start, p.think_open))
        if p.grammar is not None:
            import llguidance

            if self._llg_tokenizer is None:
                import llguidance.hf

                self._llg_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer,
                                                                   eos_token=self._loaded.info.eos_token_ids[0])
            matcher = llguidance.LLMatcher(self._llg_tokenizer, p.grammar)
            after = think_end if p.grammar_after_thinking else None
            seq.grammar = GrammarMask(matcher, self._loaded.info.eos_token_ids[0], self._vocab_size, after)
            chain.append(seq.grammar)
        sampler = self._sampler(p)
        if sampler is not None:
            chain.append(sampler)
        return chain

    def _token_text(self, token: int) -> str:
        return self._tokenizer.decode([token]) if 0 <= token < self._vocab_size else ""

    def _insert_own_plain(self, seq: _Seq) -> int:
        if self._plain is None:  # the first sparse row of an engine without the prefix cache
            self._plain = PlainLane(self._model.language_model, prefill_step_size=self._prefill_step_size)
        req = seq.req
        processors = self._processors(seq)
        uid = self._next_mtp_uid
        self._next_mtp_uid += 1
        restore, snapshot_at = self._restore(req.prefix)
        prompt = list(req.prompt_tokens)
        kw: dict[str, Any] = {}
        if req.vision is not None:
            vk = vision_prompt_kwargs(self._model, req.prompt_tokens, req.vision, self._features)
            deltas = vk.get("rope_deltas")
            kw = {"embeds": vk["inputs_embeds"], "positions": vk.get("position_ids"),
                  "rope_delta": int(deltas.reshape(-1)[0].item()) if deltas is not None else 0}
        elif req.sparse is not None:
            prompt, kw, snapshot_at = sparse_row(prompt, req.sparse, restore.length if restore else 0, snapshot_at)
        seq.plain = self._plain.add(uid, prompt, processors=processors, restore=restore,
                                    snapshot_at=snapshot_at, **kw)
        return uid

    def _takes_mtp(self, req: Generate) -> bool:
        lane = self._mtp
        # MTP pays only while the decode batch is small (a round costs more than a plain step,
        # and more so as the batch grows: benchmarks/bench_mtp.py); rows do not change lanes later.
        return (lane is not None and req.vision is None and req.sampling.mtp and req.sparse is None
                and not req.sampling.needs_processors and len(self._by_uid) < self._mtp_max_batch)

    def _insert_mtp(self, seq: _Seq) -> int:
        assert self._mtp is not None
        req = seq.req
        sampler = self._sampler(req.sampling)
        uid = self._next_mtp_uid
        self._next_mtp_uid += 1
        seq.mtp = MTPRow(uid=uid, prompt=list(req.prompt_tokens), max_tokens=req.sampling.max_tokens, sampler=sampler)
        restore, snapshot_at = self._restore(req.prefix)
        self._mtp.add(seq.mtp, restore=restore, snapshot_at=snapshot_at)
        return uid

    def _insert(self, seq: _Seq) -> int:
        req = seq.req
        if req.vision is not None:  # the vision path: encode (or reuse) each image's features
            kwargs = vision_prompt_kwargs(self._model, req.prompt_tokens, req.vision, self._features)
        else:
            embed = self._model.get_input_embeddings(mx.array([req.prompt_tokens]), None)
            kwargs = {k: v for k, v in embed.to_dict().items() if v is not None}
        processors = self._processors(seq)
        (uid,) = self._gen.insert(
            [req.prompt_tokens],
            max_tokens=[req.sampling.max_tokens],
            prompt_kwargs=[kwargs],
            logits_processors=[processors],
        )
        return uid

    # -- update ----------------------------------------------------------------------------------
    def _on_token(self, seq: _Seq, token: int, finish_reason: str | None) -> None:
        now = time.perf_counter()
        if seq.first_token_at is None:
            seq.first_token_at = now
        seq.generated += 1
        seq.pending_ids.append(token)
        seq.emitted_ids.append(token)
        if seq.recorder is not None:
            lp = seq.recorder.take(token)
            if lp is not None:
                seq.pending_logprobs.append(lp)
        if seq.grammar is not None and seq.grammar.error is not None:
            self._finish_error(seq, GenerationFailed(f"the output grammar failed: {seq.grammar.error}"))
            return
        try:
            text = seq.detok.step(token)
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            self._finish_error(seq, GenerationFailed(f"could not detokenize token {token}"))
            return
        safe, hit = seq.stops.feed(text)
        if safe:
            seq.pending_text.append(safe)
        if hit:
            self._turn_snapshot(seq)
            self._by_uid.pop(seq.uid, None)  # type: ignore[arg-type]
            self._remove_row(seq)
            self._finish(seq, "stop")
        elif finish_reason is not None:
            self._turn_snapshot(seq)
            self._by_uid.pop(seq.uid, None)  # type: ignore[arg-type]
            if seq.mtp is not None or seq.plain is not None:  # the generator drops its own finished rows
                self._remove_row(seq)
            tail = seq.stops.flush()
            if tail:
                seq.pending_text.append(tail)
            self._finish(seq, "length" if finish_reason == "length" else "stop")

    def _release_text(self, seq: _Seq) -> None:
        if seq.pending_ids:
            logprobs = seq.pending_logprobs if seq.recorder is not None else None
            self._events.append((seq.sid, TokenDelta("".join(seq.pending_text), seq.pending_ids, logprobs)))
            seq.pending_text = []
            seq.pending_ids = []
            seq.pending_logprobs = []

    def _finish(self, seq: _Seq, reason: str) -> None:
        self._release_text(seq)
        self._by_sid.pop(seq.sid, None)
        now = time.perf_counter()
        self._events.append(
            (
                seq.sid,
                Finished(
                    reason=reason,  # type: ignore[arg-type]
                    prompt_tokens=len(seq.req.prompt_tokens),
                    completion_tokens=seq.generated,
                    ttft_s=(seq.first_token_at or now) - seq.arrived,
                    total_s=now - seq.arrived,
                    mtp_drafted=seq.mtp.drafted if seq.mtp is not None else 0,
                    mtp_accepted=seq.mtp.accepted if seq.mtp is not None else 0,
                    cached_tokens=(seq.mtp.cached_tokens if seq.mtp is not None
                                   else seq.plain.cached_tokens if seq.plain is not None else 0),
                    specprefill=seq.req.specprefill,
                ),
            )
        )

    def _finish_error(self, seq: _Seq, exc: BaseException) -> None:
        self._by_sid.pop(seq.sid, None)
        if seq.uid is not None and self._by_uid.pop(seq.uid, None) is not None:
            try:
                self._remove_row(seq)
            except Exception:
                log.exception("could not remove row %s", seq.uid)
        self._events.append((seq.sid, exc))

    def _flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            self._emit(events)

"""The plain decode lane: our own restorable prefill, several rows at a time, then a
`DecodeBatch` (GPU thread only).

mlx-vlm's `BatchGenerator` prefills inside the library and cannot start a row from a cache we
hand it, nor stop at a boundary to let us copy its state. This lane owns both halves:
- prefill: `prefill_batch.PrefillBatch`, up to `prefill_batch_size` joining rows together, one
  chunk per step, each row restored from its own snapshot (or from scratch; an attention-only
  model's snapshot as long as the prompt up to its last token, which runs again for the first
  token's logits: `snapshots.restore_for`) and snapshotted at its own requested lengths; text
  rows by token ids, vision rows by their prompt embeddings and M-RoPE positions, sparse
  SpecPrefill rows by their kept tokens at their true positions. A
  snapshot asked for at the prompt's very end (what an agent's next tool round restores) is
  taken here, from the caches the finished rows leave the prefill with, before they decode;
- decode: `decode_batch.DecodeBatch`, the rows a chunk finished joining it together, each with
  its own M-RoPE delta, stepped by one compiled function (`decode_step.DecodeStep`). A row's first
  token comes out in the step that finished its prompt (the batch feeds it on its next step). A row's
  sequence ends at end-of-sequence or max_tokens (reported in `LaneStep`), but the row stays in
  the batch until the engine removes it, so its turn snapshot can still be taken;
- mixed (`mixed`; `EngineConfig.mixed_steps`): in a step that runs both, the decode step rides in the prefill
  chunk's forward (`DecodeStep.beside`: one forward, each layer's weights read once for both, as
  vLLM v1 batches decode tokens with prefill chunks); else the decode step is queued first.

tests/test_prefix_cache.py pins that image rows decode here exactly as on mlx-vlm's
BatchGenerator (same tokens, cache or not); tests/test_prefix_engine.py that rows prefilled
together equal rows prefilled alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.lane import LaneStep, RowSpec, RowTokens, sequence_end
from mlx_relay.engine.lanes.decode_batch import DecodeBatch
from mlx_relay.engine.lanes.decode_state import DecodeState, batch_bucket
from mlx_relay.engine.lanes.decode_step import DecodeStep
from mlx_relay.engine.lanes.prefill_batch import PrefillBatch, Prefilled, PrefillRow
from mlx_relay.engine.lanes.row_prefill import RowPrefill
from mlx_relay.engine.lanes.stage_forward import ModelForward, StageForward
from mlx_relay.engine.memory.batch_caches import as_batch_caches
from mlx_relay.engine.memory.snapshot_codec import CacheLayout, probe_layout
from mlx_relay.engine.memory.snapshots import Snapshot, restore_for, snapshot_caches
from mlx_relay.engine.models import Chunk
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import fresh_caches
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.positions import text_positions
from mlx_relay.engine.models.prefill_options import PrefillOptions

log = logging.getLogger(__name__)


@dataclass
class PlainRow:
    spec: RowSpec
    cached_tokens: int = 0  # restored from the prefix cache
    emitted: int = 0


class PlainLane:
    name: Literal["plain"] = "plain"

    def __init__(self, lm: Any, *, prefill_batch_size: int, prefill_step_size: int, eos_token_ids: list[int],
                 compiled: bool = True, fixed_prefill_shapes: bool = False, stage: Stage | None = None,
                 prefill_options: PrefillOptions | None = None, mixed: bool = True,
                 parts: CompiledParts | None = None,
                 kv_quant: KVQuant | None = None) -> None:
        self.lm = lm
        self.kv_quant = kv_quant  # the attention layers' keys and values quantized (`models.kv_quant`)
        # the decode step rides in the prefill chunk's forward (not on a pipeline stage: the mixed
        # step's decode rows would cross the stage boundaries inside the chunk's, which no transfer carries)
        self.mixed = mixed and stage is None
        self.eos = frozenset(eos_token_ids)
        self.prefill = PrefillBatch(lm, max_rows=prefill_batch_size, token_budget=prefill_step_size,
                                    fixed_shapes=fixed_prefill_shapes,
                                    forward=ModelForward(lm, prefill_options, parts) if stage is None
                                    else StageForward(lm, stage, prefill_options, parts))
        self.rows: dict[int, PlainRow] = {}  # every row of the lane, prefilling or decoding
        # the decode step's experts as a prefill chunk's (from the options' pairs, grouped: `layers._experts`)
        self._step = DecodeStep(lm, compiled=compiled, stage=stage, options=prefill_options)
        self._batch = DecodeBatch(self._step)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def has_work(self) -> bool:
        return bool(self.rows)

    @property
    def decode_tokens(self) -> int:
        return len(self._batch)

    @property
    def prefilling(self) -> int:
        return min(len(self.prefill), self.prefill.max_rows)

    @property
    def finishing_costs(self) -> list[int]:
        return self.prefill.finishing_costs()

    def add(self, spec: RowSpec) -> None:
        pre = RowPrefill(prompt=spec.prompt, cache=self._fresh_caches(), embeds=spec.embeds,
                         positions=spec.positions, rope_delta=spec.rope_delta)
        if spec.restore is not None:
            pre.cache, pre.done = restore_for(spec.restore, len(spec.prompt))
            pre.cached_tokens = pre.done
        pre.snapshot_at = sorted(s for s in spec.snapshot_at if pre.done < s <= len(spec.prompt))
        self.rows[spec.rid] = PlainRow(spec, cached_tokens=pre.cached_tokens)
        self.prefill.add(PrefillRow(spec.rid, pre, spec.processors))

    def cached_tokens(self, rid: int) -> int:
        row = self.rows.get(rid)
        return row.cached_tokens if row is not None else 0

    def remove(self, rid: int) -> None:
        if self.rows.pop(rid, None) is not None:
            self.prefill.remove(rid)
            self._batch.remove(rid)

    def clear(self) -> None:
        self.prefill.clear()
        self.rows.clear()
        self._batch = DecodeBatch(self._step)

    def close(self) -> None:
        pass

    def drafts(self, rid: int) -> None:
        return None

    def cache_layout(self) -> CacheLayout:
        return probe_layout(self.lm, quant=self.kv_quant)

    def _fresh_caches(self) -> list[Any]:
        return fresh_caches(self.lm, self._step.family.make_caches(self.lm), self.kv_quant)

    def warm(self, vocab_size: int, max_rows: int) -> str:
        shapes = self.warm_prefill(vocab_size, lambda rows, n, seconds: log.info(
            "warm-up: prefill of %d row(s) x %d tokens took %.2fs", rows, n, seconds))
        said = f"prefill run at {shapes} chunk shapes, decode step traced at {self.warm_decode(max_rows)} batch sizes"
        mixed = self.warm_mixed(max_rows)
        return said + (f", mixed steps' compiled parts traced at {mixed} shapes" if mixed else "")

    def extract(self, rid: int) -> Snapshot | None:
        """The state of a decoding row: its prompt and every token it has emitted."""
        row = self.rows.get(rid)
        if row is None or rid in self.prefill:
            return None
        length = len(row.spec.prompt) + self._batch.fed(rid, row.emitted)
        entries, nbytes = snapshot_caches(self._batch.extract(rid), length)
        return Snapshot(length=length, target=entries, nbytes=nbytes)

    def warm_prefill(self, vocab_size: int,
                     on_shape: Callable[[int, int, float], None] | None = None) -> int:
        """Run a prefill chunk at every (rows, length) shape the prefill can run at, rows from
        empty caches, so no prompt meets a first-shape compile; `on_shape(rows, length, seconds)`
        hears each; returns how many shapes."""
        shapes = self.prefill.shapes()
        for rows, n in shapes:
            tic = time.perf_counter()
            for j in range(rows):
                prompt = [(7 * j + i) % max(1, vocab_size - 1) + 1 for i in range(n)]
                caches = self._fresh_caches()
                self.prefill.add(PrefillRow(-(j + 1), RowPrefill(prompt=prompt, cache=caches)))
            while len(self.prefill):
                self.prefill.step()
            if on_shape is not None:
                on_shape(rows, n, time.perf_counter() - tic)
        return len(shapes)

    def warm_decode(self, max_rows: int) -> int:
        """Trace the decode step at every batch size it can run at (idle rows only), so no
        request meets a first-shape compile; returns how many sizes."""
        cache = self._idle_row()
        sizes = sorted({batch_bucket(n) for n in range(1, max_rows + 1)})
        for size in sizes:
            state = DecodeState.from_batch_caches(as_batch_caches(cache), [0])
            state.pad_to(size)
            mx.eval(self._step(mx.zeros((size,), dtype=mx.int32), state))
        return len(sizes)

    def _idle_row(self) -> list[Any]:
        """A row's caches after a one-token prompt: what the warm-ups pad their batches with."""
        cache = self._fresh_caches()
        self._step.family.prefill_forward(self.lm, mx.array([[0]]), None, cache, mx.zeros((3, 1, 1), dtype=mx.int32),
                                          self.prefill.forward.options)
        mx.eval([c.state for c in cache])
        return cache

    def warm_mixed(self, max_rows: int) -> int:
        """Trace the compiled parts of a mixed step (`models/compiled_parts.py`) at every batch size the
        decode step runs at beside a one-row chunk of every fixed length whose layers run compiled
        (idle rows, a chunk from empty caches: the parts' shapes do not depend on the context), so
        no decoding row waits on a first-shape trace beside a long prompt; returns how many shapes."""
        forward = self.prefill.forward
        lengths = [n for n in self.prefill.lengths or () if forward.options.compiles(n, cuda_kernels_available())]
        if not self.mixed or not lengths:
            return 0
        cache = self._idle_row()
        sizes = sorted({batch_bucket(n) for n in range(1, max_rows + 1)})
        for i, (size, n) in enumerate((size, n) for size in sizes for n in lengths):
            traced = forward.parts.traces
            state = DecodeState.from_batch_caches(as_batch_caches(cache), [0])
            state.pad_to(size)
            positions = text_positions(0, n)
            chunk = Chunk(mx.zeros((1, n), dtype=mx.int32), None, as_batch_caches(self._fresh_caches()), positions)
            mx.eval(self._step.beside(chunk, mx.zeros((size,), dtype=mx.int32), state, forward.options, forward.parts))
            if i == 0 and forward.parts.traces == traced:  # the family compiles no part (its chunks run eagerly)
                return 0
        return len(sizes) * len(lengths)

    def step(self, prefill_budget: int | None = None) -> LaneStep:
        """One decode step of the decoding rows and one prefill chunk of the joining rows, of at
        most `prefill_budget` tokens (the rows it finishes join the decode batch, their first
        tokens out with this step's): one forward for both where the lane mixes, else the decode
        step queued first."""
        out = LaneStep()
        if self.mixed and len(self._batch) and len(self.prefill) and (prefill_budget is None or prefill_budget > 0):
            tokens, state = self._batch.pending()
            logits: list[mx.array] = []

            def beside(chunk: Chunk) -> mx.array:
                forward = self.prefill.forward
                hidden, rows = self._step.beside(chunk, tokens, state, forward.options, forward.parts)
                logits.append(rows)
                return hidden

            chunk = self.prefill.step(prefill_budget, run=beside)
            out.mixed = bool(logits)
            self._emit(self._batch.step(logits[0] if logits else None), out)
        else:
            self._emit(self._batch.step(), out)
            chunk = self.prefill.step(prefill_budget) if len(self.prefill) else None
        if chunk is not None:
            out.prefill_rows, out.prefill_tokens = chunk.rows, chunk.tokens
            out.snapshots.extend(chunk.snapshots)
            if (done := chunk.done) is not None:
                out.snapshots.extend(_ends(done))
                self._batch.join([r.rid for r in done.rows], done.caches, done.first,
                                 [r.pre.rope_delta for r in done.rows], [r.processors for r in done.rows])
                self._emit(list(zip([r.rid for r in done.rows], done.first.tolist(), strict=True)), out)
        return out

    def _emit(self, tokens: list[tuple[int, int]], out: LaneStep) -> None:
        for rid, token in tokens:
            row = self.rows[rid]
            row.emitted += 1
            out.tokens.append(RowTokens(rid, [token], sequence_end(token, row.emitted, row.spec.max_tokens, self.eos)))


def _ends(done: Prefilled) -> list[tuple[int, Snapshot]]:
    """Snapshots at the prompt's end of the rows that asked for one (the prefill takes those
    inside the prompt: a chunk stops there), from the caches the rows leave the prefill with."""
    out: list[tuple[int, Snapshot]] = []
    for i, row in enumerate(done.rows):
        end = len(row.pre.prompt)
        if row.pre.wants_snapshot(end):
            target, nbytes = snapshot_caches([c.extract(i) for c in done.caches], end)
            out.append((row.rid, Snapshot(length=end, target=target, nbytes=nbytes)))
    return out

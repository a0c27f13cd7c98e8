"""The text path's speculative decoding under continuous batching (GPU thread only): the MTP head's
drafts and drafts copied from each row's context, verified by one round.

Rows decode in cohorts, one *round* per engine step: the head drafts ``k - 1`` tokens per row, or
a row verifies up to `max_context` tokens copied from its context instead (`round_drafts`: which
rows, at which width), the target verifies ``[bonus, d_1 ..]`` in one forward, each row keeps its
accepted drafts plus one token of the target's, and the head re-reads the accepted positions for
the next round's first draft. A checkpoint without a head gets the lane too (an `MTPHead` without
a drafter: the target's output head only), verifying context drafts alone. The pieces, one
module each:

- `mtp_prefill.MTPPrefill`: joining rows, each prefilled alone, chunk by chunk, within the lane's
  share of the step's prefill budget (snapshots taken and restored, the head's state too);
- `mtp_cohort.EagerCohort`: rows in mlx-vlm's batch caches, verified by one of the two verifiers
  (`mtp_verify`: `ExactVerifier`, batch-invariant, the default on Metal; `BatchedVerifier`, one
  forward for the block) and decided by `mtp_sampling` (argmax for greedy rows, the
  speculative-sampling walk for sampling rows);
- `mtp_compiled.CompiledCohort`: with `compiled=True` and the batched verifier, greedy rows
  whose whole round is one compiled call (`mtp_step.MTPStep` over `mtp_state.MTPState`).
  Sampling rows, rows with an output grammar (masked inside the eager round: `mtp_grammar`),
  every row under the exact verifier, and every row of a model `MTPStep` does not support keep
  the eager cohort (counted in `MTPCounts.fallback_rounds`).

Each cohort runs one round per step; rows join after their prefill and leave by filtering their
cohort's state, so a cohort never stops for newcomers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.lane import LaneStep, RowSpec, RowTokens, sequence_end
from mlx_relay.engine.lanes.mtp_cohort import EagerCohort
from mlx_relay.engine.lanes.mtp_compiled import CompiledCohort
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_prefill import MTPPrefill
from mlx_relay.engine.lanes.mtp_rows import MTPRow
from mlx_relay.engine.lanes.mtp_step import MTPStep
from mlx_relay.engine.lanes.mtp_verify import BatchedVerifier, ExactVerifier
from mlx_relay.engine.lanes.stage_forward import ModelForward, StageForward
from mlx_relay.engine.memory.snapshot_codec import CacheLayout, probe_layout
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.models import UnsupportedModel
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import fresh_caches
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.positions import text_positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.scheduling.token_budget import PREFILL_GRANULE
from mlx_relay.engine.speculation.draft_model import DraftModel


class MTPLane:
    name: Literal["mtp"] = "mtp"

    def __init__(self, lm: Any, head: MTPHead, *, block_size: int, prefill_step_size: int,
                 eos_token_ids: Sequence[int], exact_verify: bool = True, compiled: bool = True,
                 stage: Stage | None = None, max_context: int = 0, always_context: bool = False,
                 prefill_options: PrefillOptions | None = None, draft: DraftModel | None = None,
                 kv_quant: KVQuant | None = None, parts: CompiledParts | None = None) -> None:
        if block_size < 2:
            raise ValueError("MTP block size must be at least 2")
        if stage is not None and exact_verify:
            raise ValueError("a pipeline stage verifies with the batched forward (mlx-vlm's exact verifier runs "
                             "the whole model)")
        self.lm = lm
        self.head = head
        self.k = block_size
        self.eos = frozenset(eos_token_ids)
        # a draft model's drafts ride at the host drafts' width: a round verifies as many as the context's
        if draft is not None:
            max_context = max(max_context, draft.info.tokens)
        self.max_context = max_context  # host drafts per round at most (0: the head's only)
        self.draft = draft  # rows that ask for it take their host drafts from it
        # the batched verify's forward: the model, or this pipeline stage of it (which answers every
        # rank the whole model's hidden states); the prefill's: the family's prefill, or the stage's
        run: Any = lm if stage is None else StageForward(lm, stage)
        self.kv_quant = kv_quant  # the target's attention keys and values quantized (`models.kv_quant`)
        # the prefill's own forward (small chunks compiled per part, `models/compiled_parts.py`)
        self.prefill_forward = ModelForward(lm, prefill_options, parts) if stage is None else None
        self._prefill = MTPPrefill(lm, self.prefill_forward or run, head, prefill_step_size, kv_quant)
        verify = ExactVerifier(lm) if exact_verify else BatchedVerifier(run)
        self._eager = EagerCohort(lm, head, verify, block_size=block_size, eos=self.eos, fallback=compiled,
                                  max_context=max_context, always_context=always_context, weigh_head=stage is None)
        # the compiled greedy cohort; the compiled round verifies the block with one batched
        # forward, so an exact (batch-invariant) verifier keeps the eager round
        self._compiled: CompiledCohort | None = None
        if compiled and not exact_verify:
            try:
                step = MTPStep(lm, head, block_size=block_size, eos_token_ids=list(eos_token_ids), stage=stage)
                self._compiled = CompiledCohort(step, block_size=block_size, max_context=max_context,
                                                always_context=always_context)
            except UnsupportedModel:
                self._compiled = None

    def _cohorts(self) -> tuple[EagerCohort | CompiledCohort, ...]:
        return (self._eager,) if self._compiled is None else (self._eager, self._compiled)

    def _all_rows(self) -> tuple[MTPRow, ...]:
        return (*(r for c in self._cohorts() for r in c.rows), *self._prefill.rows)

    def __len__(self) -> int:
        return len(self._all_rows())

    @property
    def has_work(self) -> bool:
        return bool(self._all_rows())

    # -- membership -------------------------------------------------------------------------------
    def add(self, spec: RowSpec) -> None:
        """Queue a row for prefill: from scratch, or from `spec.restore` (its state at the
        snapshot's length; the head's too when the snapshot has it), taking snapshots at
        `spec.snapshot_at`. Every row of the lane verifies `block_size` tokens per round."""
        if spec.block_size != self.k:
            raise ValueError(f"this MTP lane verifies blocks of {self.k}, not {spec.block_size}")
        # a grammar row verifies the head's drafts only (its matcher walks them)
        context = 0 if spec.grammar is not None else min(spec.context_drafts, self.max_context)
        drafter = self.draft if spec.draft_model else None
        if spec.draft_model and drafter is None:
            raise ValueError("this MTP lane has no draft model")
        self._prefill.add(MTPRow(rid=spec.rid, prompt=spec.prompt, max_tokens=spec.max_tokens, sampler=spec.sampler,
                                 grammar=spec.grammar, use_head=spec.use_head, max_context=context,
                                 drafter=drafter, copy_drafts=spec.copy_drafts),
                          spec.restore, spec.snapshot_at)

    def cached_tokens(self, rid: int) -> int:
        row = next((r for r in self._all_rows() if r.rid == rid), None)
        return row.cached_tokens if row is not None else 0

    def drafts(self, rid: int) -> dict[str, tuple[int, int]]:
        """Per source, (drafted, accepted) of a row so far (verified drafts)."""
        row = next((r for r in self._all_rows() if r.rid == rid), None)
        if row is None:
            return {}
        return {s: (t.drafted, t.accepted) for s, t in row.earnings.tallies.items()}

    @property
    def decode_tokens(self) -> int:
        """Tokens a round of the cohorts verifies: a block per row."""
        return sum(len(c.rows) for c in self._cohorts()) * self.k

    @property
    def prefilling(self) -> int:
        return len(self._prefill.rows)

    @property
    def finishing_costs(self) -> list[int]:
        return self._prefill.finishing_costs()

    def step(self, prefill_budget: int | None = None) -> LaneStep:
        """One round of each cohort, then a prefill chunk of every joining row, the rows sharing
        `prefill_budget` tokens (`token_budget.fair_shares`; None: the oldest row alone, one
        `prefill_step_size` chunk)."""
        out = LaneStep()
        for cohort in self._cohorts():
            if not cohort.rows:
                continue
            rows = cohort.rows
            result = cohort.round()
            out.mtp.add(result.counts)
            for row in rows:
                tokens = result.tokens.get(row.rid)
                if tokens:
                    out.tokens.append(RowTokens(row.rid, tokens,
                                                sequence_end(tokens[-1], row.emitted, row.max_tokens, self.eos)))
        joined, out.prefill_tokens = self._prefill.step(prefill_budget, self._join)
        if (joined or out.prefill_tokens) and self._compiled is not None:
            self._compiled.other_work()
        for row in self._all_rows():
            if row.snapshots:
                out.snapshots.extend((row.rid, s) for s in row.snapshots)
                row.snapshots.clear()
        for row, token in joined:
            out.tokens.append(RowTokens(row.rid, [token], sequence_end(token, row.emitted, row.max_tokens, self.eos)))
        return out

    def _join(self, row: MTPRow, first: mx.array, draft: mx.array, logq: mx.array | None, seed_h: mx.array) -> None:
        """A prefilled row joins its cohort: the compiled one when it is greedy without a grammar and
        there is one (the compiled round takes no per-row mask: a grammar row runs the eager round)."""
        row.start_context(int(first.item()))
        if self._compiled is not None and row.sampler is None and row.grammar is None:
            self._compiled.join(row, first, draft, seed_h)
        else:
            self._eager.join(row, first, draft, logq, seed_h)

    def extract(self, rid: int) -> Snapshot | None:
        """The state of a cohort row: every emitted token but the last (target caches only)."""
        if self._compiled is not None and (snap := self._compiled.extract(rid)) is not None:
            return snap
        return self._eager.extract(rid)

    def remove(self, rid: int) -> None:
        if self._prefill.remove(rid) or (self._compiled is not None and self._compiled.remove(rid)):
            return
        self._eager.remove(rid)

    def clear(self) -> None:
        self._prefill.rows = []
        for cohort in self._cohorts():
            cohort.clear()

    def close(self) -> None:
        pass

    def cache_layout(self) -> CacheLayout:
        """The target's layout and, where the head drafts, the head's (a snapshot carries both)."""
        return probe_layout(self.lm, self.head if self.head.drafts else None, self.kv_quant)

    def warm(self, vocab_size: int, max_rows: int) -> str:
        """Trace the compiled round's shapes and the prefill chunks' compiled parts, and forget what
        the warm-up's rows (synthetic tokens) taught the cohorts' round plans of the head's
        acceptance (`RoundDrafts.forget`)."""
        sizes = self.warm_rounds(max_rows)
        for cohort in self._cohorts():
            cohort.forget()
        chunks = self.warm_prefill_parts()
        return f"compiled MTP round traced at {sizes} batch sizes" + (
            f", prefill chunks' compiled parts at {chunks} lengths" if chunks else "")

    def warm_prefill_parts(self) -> int:
        """Trace the compiled parts of the prefill chunks this lane's rows take (one row; a share of
        the step's budget, a multiple of `PREFILL_GRANULE` tokens, up to the step size) at every
        length whose layers run compiled, so no row's chunk waits on a first-shape trace; returns
        how many lengths."""
        forward = self.prefill_forward
        if forward is None:
            return 0
        cuda = cuda_kernels_available()
        lengths = [n for n in range(PREFILL_GRANULE, self._prefill.prefill_step_size + 1, PREFILL_GRANULE)
                   if forward.options.compiles(n, cuda)]
        for n in lengths:
            caches = fresh_caches(self.lm, self.lm.make_cache(), self.kv_quant)
            positions = text_positions(0, n)
            mx.eval(forward.prefill(mx.zeros((1, n), dtype=mx.int32), None, caches, positions))
        return len(lengths)

    def warm_rounds(self, max_rows: int) -> int:
        """Trace the compiled round at every batch size its cohort can run at (idle rows from a
        one-token prefill), so no request meets a first-shape compile; returns how many sizes."""
        return 0 if self._compiled is None else self._compiled.warm(self.lm, self.head, max_rows, self.kv_quant)

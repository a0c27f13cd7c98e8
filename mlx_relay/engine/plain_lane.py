"""The plain decode lane: our own restorable prefill, then a `DecodeBatch` (GPU thread only).

mlx-vlm's `BatchGenerator` prefills inside the library and cannot start a row from a cache we
hand it, nor stop at a boundary to let us copy its state. This lane owns both halves:
- prefill: each joining row alone, chunk by chunk (`RowPrefill`: restored from a snapshot,
  snapshotted at the requested lengths), text rows by token ids, vision rows by their prompt
  embeddings and M-RoPE positions, sparse SpecPrefill rows by their kept tokens at their true
  positions;
- decode: `decode_batch.DecodeBatch`, each prefilled row joining it with its own M-RoPE delta.
  A row's sequence ends at end-of-sequence or max_tokens (reported in `LaneStep`), but the row
  stays in the batch until the engine removes it, so its turn snapshot can still be taken.

tests/test_prefix_cache.py pins that image rows decode here exactly as on mlx-vlm's
BatchGenerator (same tokens, cache or not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx

from mlx_relay.engine.decode_batch import DecodeBatch
from mlx_relay.engine.lanes import LaneStep, RowSpec, RowTokens, ending_of
from mlx_relay.engine.row_prefill import RowPrefill, as_batch_caches
from mlx_relay.engine.snapshots import Snapshot, restore_caches, snapshot_caches


@dataclass
class PlainRow:
    spec: RowSpec
    pre: RowPrefill
    emitted: int = 0
    snapshots: list[Snapshot] = field(default_factory=list)


class PlainLane:
    name: Literal["plain"] = "plain"

    def __init__(self, lm: Any, *, prefill_step_size: int, eos_token_ids: list[int]) -> None:
        self.lm = lm
        self.prefill_step_size = prefill_step_size
        self.eos = frozenset(eos_token_ids)
        self.prefilling: list[PlainRow] = []
        self.rows: dict[int, PlainRow] = {}
        self._batch = DecodeBatch(lm)

    def __len__(self) -> int:
        return len(self.rows) + len(self.prefilling)

    @property
    def has_work(self) -> bool:
        return bool(self.rows) or bool(self.prefilling)

    def add(self, spec: RowSpec) -> None:
        pre = RowPrefill(prompt=spec.prompt, cache=self.lm.make_cache(), embeds=spec.embeds, positions=spec.positions,
                         rope_delta=spec.rope_delta)
        if spec.restore is not None:
            pre.cache, pre.done = restore_caches(spec.restore.target), spec.restore.length
            pre.cached_tokens = spec.restore.length
        pre.snapshot_at = sorted(s for s in spec.snapshot_at if pre.done < s < len(spec.prompt))
        self.prefilling.append(PlainRow(spec, pre))

    def cached_tokens(self, rid: int) -> int:
        row = self.rows.get(rid) or next((r for r in self.prefilling if r.spec.rid == rid), None)
        return row.pre.cached_tokens if row is not None else 0

    def remove(self, rid: int) -> None:
        self.prefilling = [r for r in self.prefilling if r.spec.rid != rid]
        if self.rows.pop(rid, None) is not None:
            self._batch.remove(rid)

    def clear(self) -> None:
        self.prefilling.clear()
        self.rows.clear()
        self._batch = DecodeBatch(self.lm)

    def extract(self, rid: int) -> Snapshot | None:
        """The state of a decoding row: its prompt and every token it has emitted."""
        row = self.rows.get(rid)
        if row is None:
            return None
        length = len(row.spec.prompt) + row.emitted
        entries, nbytes = snapshot_caches(self._batch.extract(rid), length)
        return Snapshot(length=length, target=entries, nbytes=nbytes)

    def step(self) -> LaneStep:
        """One decode step of the joined rows, then one prefill chunk of the oldest joining row."""
        out = LaneStep()
        for rid, token in self._batch.step():
            row = self.rows[rid]
            row.emitted += 1
            out.tokens.append(RowTokens(rid, [token], ending_of(token, row.emitted, row.spec.max_tokens, self.eos)))
        joining = self._prefill_chunk()
        if joining is not None and joining.snapshots:
            out.snapshots.extend((joining.spec.rid, s) for s in joining.snapshots)
            joining.snapshots.clear()
        return out

    def _prefill_chunk(self) -> PlainRow | None:
        """Advance the oldest prefilling row by one chunk; it joins the batch once its prompt is
        done (its first token comes out of the batch's next step)."""
        if not self.prefilling:
            return None
        row = self.prefilling[0]
        pre = row.pre
        end = pre.next_end(self.prefill_step_size)
        if end == len(pre.prompt) and end - pre.done > 1:
            end -= 1  # the last token alone: only its logits are needed (as mlx-vlm's prefill does)
        # chunks before the last evaluate only the caches: the last layer's outputs there, which
        # nothing reads, are never computed
        out = pre.forward(self.lm, end, skip_logits=end < len(pre.prompt))
        if pre.wants_snapshot(end):
            target, nbytes = snapshot_caches(pre.cache, end)
            row.snapshots.append(Snapshot(length=end, target=target, nbytes=nbytes))
        if not pre.finished:
            mx.eval([c.state for c in pre.cache])
            return row
        self.prefilling.pop(0)
        logits = out.logits[:, -1, :]
        for proc in row.spec.processors:
            logits = proc(mx.array(pre.prompt), logits)
        first = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(first, [c.state for c in pre.cache])
        self._batch.join(row.spec.rid, as_batch_caches(pre.cache), first, pre.rope_delta, row.spec.processors)
        pre.cache, pre.embeds, pre.positions = [], None, None
        self.rows[row.spec.rid] = row
        return row

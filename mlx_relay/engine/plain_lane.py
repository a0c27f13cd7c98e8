"""The plain decode lane with our own prefill, for the prefix cache (GPU thread only).

mlx-vlm's `BatchGenerator` prefills inside the library and cannot start a row from a cache we
hand it, nor stop at a boundary to let us copy its state. This lane keeps the library's decode
loop and owns the prefill:
- prefill: each joining row alone, chunk by chunk (`RowPrefill`: restored from a snapshot,
  snapshotted at the requested lengths), text rows by token ids, vision rows by their prompt
  embeddings and M-RoPE positions;
- decode: mlx-vlm's public `GenerationBatch` (double-buffered steps, fused greedy decode), each
  prefilled row joining it through `extend`. Rows end only when the engine says so (EOS,
  max_tokens, stop strings): the lane's own stop criteria never fire, so a finished row's state
  is still in the batch when the engine asks for its turn snapshot, then it is filtered out.

`GenerationBatch` takes per-row M-RoPE deltas through its `_rope_deltas` attribute, which the
library's own BatchGenerator sets the same way after a prefill; tests/test_prefix_cache.py pins
that image rows decode here exactly as on mlx-vlm's BatchGenerator (same tokens, cache or not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_vlm.generate.ar import GenerationBatch

from mlx_relay.engine.row_prefill import RowPrefill, as_batch_caches
from mlx_relay.engine.snapshots import Snapshot, restore_caches, snapshot_caches

_NEVER = 1 << 40  # the lane's own max_tokens: the engine finishes rows


@dataclass
class PlainRow:
    uid: int
    pre: RowPrefill
    processors: list[Any] = field(default_factory=list)  # e.g. a RowSampler; empty: greedy
    emitted: int = 0
    snapshots: list[Snapshot] = field(default_factory=list)

    @property
    def cached_tokens(self) -> int:
        return self.pre.cached_tokens



class PlainLane:
    def __init__(self, lm: Any, *, prefill_step_size: int) -> None:
        self.lm = lm
        self.prefill_step_size = prefill_step_size
        self.prefilling: list[PlainRow] = []
        self.rows: dict[int, PlainRow] = {}
        self._batch = self._empty()

    def _empty(self) -> GenerationBatch:
        return GenerationBatch.empty(self.lm, lambda x: mx.argmax(x, axis=-1), lambda _tok: False,
                                     compute_logprobs=False, greedy_sampling=True)

    def __len__(self) -> int:
        return len(self.rows) + len(self.prefilling)

    @property
    def has_work(self) -> bool:
        return bool(self.rows) or bool(self.prefilling)

    def add(self, uid: int, prompt: list[int], *, processors: list[Any], restore: Snapshot | None = None,
            snapshot_at: Sequence[int] = (), embeds: mx.array | None = None, positions: mx.array | None = None,
            rope_delta: int = 0) -> PlainRow:
        pre = RowPrefill(prompt=prompt, cache=self.lm.make_cache(), embeds=embeds, positions=positions,
                         rope_delta=rope_delta)
        if restore is not None:
            pre.cache, pre.done = restore_caches(restore.target), restore.length
            pre.cached_tokens = restore.length
        pre.snapshot_at = sorted(s for s in snapshot_at if pre.done < s < len(prompt))
        row = PlainRow(uid=uid, pre=pre, processors=processors)
        self.prefilling.append(row)
        return row

    def remove(self, uid: int) -> None:
        for i, row in enumerate(self.prefilling):
            if row.uid == uid:
                del self.prefilling[i]
                return
        if self.rows.pop(uid, None) is not None:
            self._batch.filter([i for i, u in enumerate(self._batch.uids) if u != uid])

    def clear(self) -> None:
        self.prefilling.clear()
        self.rows.clear()
        self._batch = self._empty()

    def extract(self, uid: int) -> Snapshot | None:
        """The state of a decoding row: its prompt and every token it has emitted."""
        row = self.rows.get(uid)
        if row is None:
            return None
        i = self._batch.uids.index(uid)
        caches = [c.extract(i) for c in self._batch.prompt_cache]
        length = len(row.pre.prompt) + row.emitted
        entries, nbytes = snapshot_caches(caches, length)
        return Snapshot(length=length, target=entries, nbytes=nbytes)

    # -- prefill: one chunk of one row per call ------------------------------------------------
    def prefill_step(self) -> PlainRow | None:
        """Advance the oldest prefilling row by one chunk; returns it when it has joined the batch
        (its first token comes out of the batch's next step)."""
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
            return None
        self.prefilling.pop(0)
        logits = out.logits[:, -1, :]
        for proc in row.processors:
            logits = proc(mx.array(pre.prompt), logits)
        first = mx.argmax(logits, axis=-1).astype(mx.int32)
        mx.eval(first, [c.state for c in pre.cache])
        joining = GenerationBatch(self.lm, [row.uid], first, as_batch_caches(pre.cache),
                                  lambda x: mx.argmax(x, axis=-1), lambda _tok: False, [_NEVER], greedy_sampling=True,
                                  logits_processors=[row.processors] if row.processors else None)
        joining.compute_logprobs = False
        joining._rope_deltas = mx.array([[pre.rope_delta]], dtype=mx.int32)  # as BatchGenerator does
        pre.cache, pre.embeds, pre.positions = [], None, None
        self._batch.extend(joining)
        self.rows[row.uid] = row
        return row

    # -- decode ---------------------------------------------------------------------------------
    def step(self) -> list[tuple[int, int]]:
        """One decode step of every joined row: [(uid, token)]."""
        if not self.rows:
            return []
        out = []
        for r in self._batch.next():
            row = self.rows.get(r.uid)
            if row is not None:
                row.emitted += 1
                out.append((r.uid, r.token))
        return out

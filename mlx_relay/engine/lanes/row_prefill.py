"""One request's prefill progress and state, restorable and snapshottable (GPU thread only).

The MTP lane prefills a joining row alone, chunk by chunk, into batch-1 caches, then merges them
into its cohort; the plain lane's `prefill_batch.PrefillBatch` runs the rows' chunks together
and keeps each row's progress here. That is where the prefix cache plugs in:
- restore: the row starts from a snapshot's caches at length S and prefills only prompt[S:];
- snapshot: a chunk ends exactly at each requested snapshot length, where the caches are
  snapshotted (`snapshots.snapshot_caches`) before the next chunk runs.

Positions are always explicit (M-RoPE triples: `position_ids` [3, 1, T]), so a restored or
chunked row never depends on state the model keeps between calls. Vision rows carry their
prompt embeddings (image features merged) and M-RoPE positions from the vision path; their
`rope_delta` (position - index after the image) continues into decoding. SpecPrefill rows
(`engine/lane.sparse_row`) prefill only their kept tokens at their original positions the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_relay.engine.models.positions import text_positions


@dataclass
class RowPrefill:
    prompt: list[int]
    cache: list[Any]
    done: int = 0  # prompt tokens already in `cache` (restored or prefilled)
    snapshot_at: list[int] = field(default_factory=list)  # ascending lengths in (done, len(prompt))
    embeds: mx.array | None = None  # [1, L, D] (vision rows)
    positions: mx.array | None = None  # [3, 1, L] (vision rows)
    rope_delta: int = 0  # decode position = index + rope_delta
    cached_tokens: int = 0  # restored from the prefix cache

    @property
    def finished(self) -> bool:
        return self.done >= len(self.prompt)

    def next_end(self, step: int) -> int:
        end = min(len(self.prompt), self.done + step)
        for s in self.snapshot_at:
            if self.done < s < end:
                return s
        return end

    def wants_snapshot(self, end: int) -> bool:
        return end in self.snapshot_at

    def forward(self, lm: Any, end: int, **kwargs: Any) -> Any:
        """Run prompt[done:end] through the model into the row's cache."""
        start = self.done
        chunk = mx.array([self.prompt[start:end]], dtype=mx.int32)
        if self.positions is not None:
            pos = self.positions[:, :, start:end]
        else:
            pos = text_positions(start, end)
        emb = self.embeds[:, start:end, :] if self.embeds is not None else None
        out = lm(chunk, inputs_embeds=emb, cache=self.cache, position_ids=pos, **kwargs)
        self.done = end
        return out

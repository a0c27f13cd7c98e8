"""A batch of decoding rows, one token per row per step (GPU thread only): the plain lane's decode.

Each step feeds every row's last token through the language model with the rows' own M-RoPE
deltas passed as the model's public `rope_deltas` argument (a vision row continues at position
index + delta; a sparse SpecPrefill row at the prompt's true end), applies each row's logits
processors and takes the argmax (a sampling row's `RowSampler` leaves one finite entry, so the
argmax is its draw). Rows without processors go through the model's fused greedy decode when it
has one (as mlx-vlm's own `GenerationBatch` does). Every forward runs as one batch, a lone row
too (`batch_caches.batched`: no per-step copy of a lone row's caches, no host sync). Steps are
double-buffered like mlx-lm's `generate_step`: step N's tokens are queued with `mx.async_eval`
and read at step N+1, so the host builds the next graph while the device runs this one.

Rows join with their batch caches merged in (`batch_caches.extend_caches`: each cache class's
public `extend`), several at once when a prefill chunk finishes them together, and leave through
`filter`; `extract` copies one row's caches (its turn snapshot).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.batch_caches import batched, extend_caches


class DecodeBatch:
    def __init__(self, lm: Any) -> None:
        self.lm = lm
        self.rids: list[int] = []
        self.caches: list[Any] = []
        self.processors: list[list[Any]] = []
        self._tokens: mx.array | None = None  # [B] the token each row emits next (maybe still computing)
        self._deltas: mx.array | None = None  # [B, 1] int32
        self._fused = callable(getattr(lm, "fused_greedy_decode", None))

    def __len__(self) -> int:
        return len(self.rids)

    def join(self, rids: list[int], caches: list[Any], first: mx.array, rope_deltas: list[int],
             processors: list[list[Any]]) -> None:
        """Prefilled rows join: `caches` their batch caches, `first` [len(rids)] their first tokens."""
        delta = mx.array([[d] for d in rope_deltas], dtype=mx.int32)
        if not self.rids:
            self.caches, self._tokens, self._deltas = caches, first, delta
        else:
            mx.eval(self._tokens, [c.state for c in self.caches])  # settle the pending step first
            extend_caches(self.caches, caches)
            self._tokens = mx.concatenate([self._tokens, first])  # type: ignore[list-item]
            self._deltas = mx.concatenate([self._deltas, delta])  # type: ignore[list-item]
        self.rids.extend(rids)
        self.processors.extend(processors)

    def remove(self, rid: int) -> None:
        if rid not in self.rids:
            return
        keep = [i for i, r in enumerate(self.rids) if r != rid]
        self.rids = [self.rids[i] for i in keep]
        self.processors = [self.processors[i] for i in keep]
        if not keep:
            self.caches, self._tokens, self._deltas = [], None, None
            return
        mx.eval(self._tokens, [c.state for c in self.caches])
        idx = mx.array(keep, dtype=mx.int32)
        for c in self.caches:
            c.filter(idx)
        self._tokens = self._tokens[idx]  # type: ignore[index]
        self._deltas = self._deltas[idx]  # type: ignore[index]

    def extract(self, rid: int) -> list[Any]:
        """Row `rid`'s caches (every token it has been fed)."""
        mx.eval(self._tokens, [c.state for c in self.caches])
        i = self.rids.index(rid)
        return [c.extract(i) for c in self.caches]

    def step(self) -> list[tuple[int, int]]:
        """Emit each row's pending token and queue the next: [(row, token)]."""
        if not self.rids:
            return []
        inputs = self._tokens
        assert inputs is not None
        self._tokens = self._next(inputs)
        mx.async_eval(self._tokens)
        return list(zip(self.rids, inputs.tolist(), strict=True))

    def _next(self, inputs: mx.array) -> mx.array:
        has_processors = any(self.processors)
        if self._fused and not has_processors:
            sampled = self.lm.fused_greedy_decode(inputs[:, None], cache=self.caches,
                                                  **batched(rope_deltas=self._deltas))
            if sampled is not None:
                return sampled[:, 0] if sampled.ndim == 2 else sampled
        out = self.lm(inputs[:, None], cache=self.caches, **batched(rope_deltas=self._deltas))
        logits = (out.logits if hasattr(out, "logits") else out)[:, -1, :]
        if has_processors:
            last = inputs.tolist()
            rows = []
            for i, procs in enumerate(self.processors):
                row = logits[i:i + 1]
                for proc in procs:
                    row = proc.process_last_token(last[i], row) if hasattr(proc, "process_last_token") \
                        else proc(mx.array([last[i]]), row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return mx.argmax(logits, axis=-1).astype(mx.int32)

"""A batch of decoding rows, one token per row per step (GPU thread only): the plain lane's decode.

Each step feeds every row's last token through `decode_step.DecodeStep`, the language model's
decode as one compiled function over explicit state (`decode_state.DecodeState`: each row
continues at its own position, its cache length + its M-RoPE delta, so a vision row goes on
after its image and a sparse SpecPrefill row at the prompt's true end), applies each row's
logits processors and takes the argmax (a sampling row's `RowSampler` leaves one finite entry,
so the argmax is its draw). Steps are double-buffered like mlx-lm's `generate_step`: step N's
tokens are queued with `mx.async_eval` and read at step N+1, so the host prepares the next step
while the device runs this one.

Rows join from a prefill chunk (their mlx-vlm batch caches converted once), several at once when
the chunk finishes them together, their first tokens already emitted by the lane in the step that
finished their prompts (`early`: the batch feeds them on its next step without emitting them
again, so a request's first token never waits for a whole further step), and leave through
`filter`; the batch runs padded with idle rows to its bucket size (`decode_state.batch_bucket`);
`extract` copies one row's state as library caches (its turn snapshot).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.lanes.decode_state import DecodeState, batch_bucket
from mlx_relay.engine.lanes.decode_step import DecodeStep


class DecodeBatch:
    def __init__(self, step: DecodeStep) -> None:
        self._forward = step
        self.rids: list[int] = []
        self.processors: list[list[Any]] = []
        self._state: DecodeState | None = None
        self._tokens: mx.array | None = None  # [B] the token each row emits next (maybe still computing)
        self.early: set[int] = set()  # rows whose pending token (their first) was emitted when they joined

    def __len__(self) -> int:
        return len(self.rids)

    def join(self, rids: list[int], caches: list[Any], first: mx.array, rope_deltas: list[int],
             processors: list[list[Any]]) -> None:
        """Prefilled rows join: `caches` their mlx-vlm batch caches, `first` [len(rids)] their first
        tokens (emitted by the lane as they join: the next step feeds them and emits what follows)."""
        state = DecodeState.from_batch_caches(caches, rope_deltas)
        if self._state is None:
            self._state, tokens = state, first
        else:
            assert self._tokens is not None
            mx.eval(self._tokens, self._state.arrays())  # settle the pending step first
            n = len(self.rids)
            if self._state.batch_size > n:
                self._state.filter(list(range(n)))  # drop the idle rows
            self._state.extend(state)
            tokens = mx.concatenate([self._tokens[:n], first])
        self.rids.extend(rids)
        self.early.update(rids)
        self.processors.extend(processors)
        self._pad(tokens)

    def remove(self, rid: int) -> None:
        if rid not in self.rids:
            return
        self.early.discard(rid)
        keep = [i for i, r in enumerate(self.rids) if r != rid]
        self.rids = [self.rids[i] for i in keep]
        self.processors = [self.processors[i] for i in keep]
        if not keep:
            self._state, self._tokens = None, None
            return
        assert self._state is not None and self._tokens is not None
        mx.eval(self._tokens, self._state.arrays())
        self._state.filter(keep)
        self._pad(self._tokens[mx.array(keep, dtype=mx.int32)])

    def _pad(self, tokens: mx.array) -> None:
        """Idle rows up to the batch's bucket size (few step shapes, each traced once)."""
        assert self._state is not None
        size = batch_bucket(len(self.rids))
        self._state.pad_to(size)
        idle = size - tokens.shape[0]
        self._tokens = mx.concatenate([tokens, mx.zeros((idle,), dtype=mx.int32)]) if idle > 0 else tokens

    def fed(self, rid: int, emitted: int) -> int:
        """Of a row's `emitted` tokens, how many its state holds (all but a first token not yet fed)."""
        return emitted - (1 if rid in self.early else 0)

    def extract(self, rid: int) -> list[Any]:
        """Row `rid`'s state as batch-1 library caches (every token it has been fed)."""
        assert self._state is not None
        mx.eval(self._tokens, self._state.arrays())
        return self._state.row_caches(self.rids.index(rid))

    def pending(self) -> tuple[mx.array, DecodeState]:
        """What the next step feeds: each row's pending token [B] (idle rows included) and the state."""
        assert self._tokens is not None and self._state is not None
        return self._tokens, self._state

    def step(self, logits: mx.array | None = None) -> list[tuple[int, int]]:
        """Emit each row's pending token (but a first token emitted as the row joined) and queue the
        next: [(row, token)]. `logits`: the step's, already run over `pending()` (the step rode
        in a prefill chunk's forward: `DecodeStep.beside`), else the step runs here."""
        if not self.rids:
            return []
        inputs = self._tokens
        assert inputs is not None
        self._tokens = self._next(inputs, logits)
        mx.async_eval(self._tokens)
        early, self.early = self.early, set()
        return [(rid, tok) for rid, tok in zip(self.rids, inputs.tolist()[:len(self.rids)], strict=True)
                if rid not in early]

    def _next(self, inputs: mx.array, logits: mx.array | None) -> mx.array:
        assert self._state is not None
        if logits is None:
            logits = self._forward(inputs, self._state)
        if any(self.processors):
            last = inputs.tolist()
            rows = []
            for i, procs in enumerate(self.processors):
                row = logits[i:i + 1]
                for proc in procs:
                    row = proc.process_last_token(last[i], row) if hasattr(proc, "process_last_token") \
                        else proc(mx.array([last[i]]), row)
                rows.append(row)
            logits = mx.concatenate([*rows, logits[len(rows):]], axis=0)  # idle rows as they are
        return mx.argmax(logits, axis=-1).astype(mx.int32)

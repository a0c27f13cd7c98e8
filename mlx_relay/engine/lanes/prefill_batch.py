"""Joining rows prefilled together, chunk by chunk (GPU thread only): the plain lane's prefill.

Rows that join the plain lane wait here until their prompt is in their caches. Each step runs
one chunk for up to `max_rows` rows *together*, in one forward of the language model:
- each row starts from its own caches: restored from a prefix-cache snapshot (any length) or
  empty; merging them into batch caches left-pads the shorter KV prefixes (masked keys), the
  recurrent GatedDeltaNet states need no padding;
- with fixed shapes (on a GPU), a chunk is one of a few lengths (`chunk_lengths`: 16 to 256 by powers of two, then
  steps of half a power of two up to the token budget), so the device meets only shapes the
  warm-up ran (`warm`), never a prompt's own length (a new shape costs kernel compilation and
  library plans, up to seconds on a GPU); with exact shapes (on CPU, where a new length costs
  nothing extra) a chunk is as long as its longest take;
- each row takes up to the chunk's length, stopping at its next snapshot length (so at a
  boundary its caches hold exactly its prompt's state there, and its snapshot is taken then) or
  its prompt's end, capped so the chunk holds at most `token_budget` tokens, or the engine
  step's prefill share when smaller (`scheduling/token_budget.py`: a decoding row never waits on more);
  every row gets the same cap, so a short prompt that joins runs whole beside the long ones; the chunk is the
  shortest length that holds the longest take. A row that takes less is right-padded: the caches'
  public `prepare(lengths, right_padding)` keeps the padding out of its GatedDeltaNet state and
  conv window, and `finalize()` rolls its padded keys into masked left padding, so ragged
  prompts share one forward instead of one chunk per distinct length;
- each row feeds its tokens at its own positions (explicit M-RoPE triples), by token id or, for
  vision rows, by its prompt embeddings; SpecPrefill rows feed only their kept tokens at their
  original positions;
- a row whose prompt is done leaves with its first token and its caches, to join the decode
  batch; the others go on. When every row finishes in the same chunk, the batch caches move on
  whole.

Batching rows of ragged restored lengths relies on the language model's batched forward with
left-padded batch caches (`batch_caches.batched`; `tests/test_library_adapters.py` pins that
the batched chunk runs as one forward and equals each row alone).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_relay.engine.lanes.row_prefill import RowPrefill
from mlx_relay.engine.lanes.stage_forward import ModelForward
from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches, take_rows
from mlx_relay.engine.memory.snapshots import Snapshot, snapshot_caches
from mlx_relay.engine.models import Chunk
from mlx_relay.engine.models.positions import text_positions
from mlx_relay.engine.scheduling.token_budget import PREFILL_GRANULE


@dataclass
class PrefillRow:
    """A row waiting for, or in, a prefill chunk."""

    rid: int
    pre: RowPrefill
    processors: list[Any] = field(default_factory=list)  # applied to the first token's logits


@dataclass
class Prefilled:
    """Rows whose prompts are done, with their batch caches and first tokens (one per row)."""

    rows: list[PrefillRow]
    caches: list[Any]
    first: mx.array  # [len(rows)] int32


@dataclass
class PrefillStep:
    rows: int = 0  # rows the chunk ran
    tokens: int = 0  # tokens the chunk's forward ran: rows x chunk length (padding included)
    done: Prefilled | None = None
    snapshots: list[tuple[int, Snapshot]] = field(default_factory=list)  # (row, snapshot at a boundary)


def chunk_lengths(token_budget: int) -> tuple[int, ...]:
    """The lengths a prefill chunk runs at: 16, 32, 64, 128, 256, then 384, 512, 768, 1024, 1536,
    ... (powers of two and one and a half times them), below the budget, and the budget itself."""
    budget = max(1, token_budget)
    lengths, power = [], 16
    while power < budget:
        lengths.append(power)
        if power >= 256 and power + power // 2 < budget:
            lengths.append(power + power // 2)
        power *= 2
    return (*lengths, budget)


def _positions(pre: RowPrefill, end: int) -> mx.array:
    """[3, 1, n] M-RoPE positions of prompt[done:end]."""
    if pre.positions is not None:
        return pre.positions[:, :, pre.done:end]
    return text_positions(pre.done, end)


class PrefillBatch:
    def __init__(self, lm: Any, *, max_rows: int, token_budget: int, fixed_shapes: bool,
                 forward: ModelForward | None = None) -> None:
        self.lm = lm
        self.forward = forward or ModelForward(lm)  # the whole model, or this process's pipeline stage
        self.max_rows = max(1, max_rows)
        self.token_budget = max(1, token_budget)
        # fixed: chunks only at these lengths; else at the longest take (up to the budget)
        self.lengths = chunk_lengths(token_budget) if fixed_shapes else None
        self.waiting: list[PrefillRow] = []
        self.rows: list[PrefillRow] = []  # in the batch, in the caches' order
        self._caches: list[Any] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.rows)

    def __contains__(self, rid: int) -> bool:
        return any(r.rid == rid for r in (*self.waiting, *self.rows))

    def add(self, row: PrefillRow) -> None:
        self.waiting.append(row)

    def remove(self, rid: int) -> None:
        self.waiting = [r for r in self.waiting if r.rid != rid]
        keep = [i for i, r in enumerate(self.rows) if r.rid != rid]
        if len(keep) < len(self.rows):
            self._keep(keep)

    def clear(self) -> None:
        self.waiting.clear()
        self.rows.clear()
        self._caches = []

    # -- the step ---------------------------------------------------------------------------
    def step(self, budget: int | None = None, run: Callable[[Chunk], mx.array] | None = None) -> PrefillStep:
        """Admit waiting rows, then run one chunk for every row in the batch, of at most
        `budget` tokens (padding included; None or more than `token_budget`: `token_budget`;
        0: none this step, the engine holds prefill back while rows decode). `run`: the chunk's
        forward in place of `forward.prefill` (the plain lane's decode step riding in it)."""
        out = PrefillStep()
        if budget is not None and budget <= 0:
            return out
        self._admit()
        if not self.rows:
            return out
        out.rows = len(self.rows)
        takes = self._takes(budget)  # real tokens per row
        n = max(takes) if self.lengths is None else next(n for n in self.lengths if n >= max(takes))
        out.tokens = n * len(self.rows)
        padded = any(t < n for t in takes)
        if padded:
            for c in self._caches:
                c.prepare(lengths=takes, right_padding=[n - t for t in takes])
        ids, embeds, positions = self._inputs(n, takes)
        hidden = run(Chunk(ids, embeds, self._caches, positions)) if run is not None \
            else self.forward.prefill(ids, embeds, self._caches, positions)
        if padded:
            for c in self._caches:
                c.finalize()
        finished: list[int] = []
        for i, row in enumerate(self.rows):
            row.pre.done += takes[i]
            if row.pre.finished:
                finished.append(i)
            elif row.pre.wants_snapshot(row.pre.done):
                out.snapshots.append((row.rid, self._snapshot(i)))
        if not finished:
            mx.eval([c.state for c in self._caches])
            return out
        first = self._first_tokens(hidden, finished, takes)
        out.done = self._release(finished, first)
        return out

    def _admit(self) -> None:
        joining = self.waiting[:self.max_rows - len(self.rows)]
        if not joining:
            return
        self.waiting = self.waiting[len(joining):]
        for row in joining:
            caches = as_batch_caches(row.pre.cache)
            row.pre.cache = []
            if not self.rows:
                self._caches = caches
            else:
                extend_caches(self._caches, caches)
            self.rows.append(row)

    def cap(self, rows: int, budget: int | None = None) -> int:
        """The longest chunk `rows` rows run at: the longest length within the token budget (or
        `budget`, when smaller: the engine step's share), the shortest length if none is."""
        limit = self.token_budget if budget is None else max(1, min(budget, self.token_budget))
        if self.lengths is None:  # exact shapes: a multiple of the GatedDeltaNet prefill's chunk
            n = max(1, limit // rows)
            return n - n % PREFILL_GRANULE if n >= PREFILL_GRANULE else n
        within = [n for n in self.lengths if n * rows <= limit]
        return within[-1] if within else self.lengths[0]

    def finishing_costs(self) -> list[int]:
        """For each row the next chunk would run (those in the batch, then those it would admit):
        the budget with which that chunk finishes the row's prompt: every row of the chunk runs as
        many positions (the chunk's length, at least the row's remaining tokens), so the rows times
        that length; none for a row the chunk cannot finish within the token budget."""
        rows = [*self.rows, *self.waiting[:self.max_rows - len(self.rows)]]
        out = []
        for row in rows:
            left = len(row.pre.prompt) - row.pre.done
            n = left if self.lengths is None else next((n for n in self.lengths if n >= left), None)
            if n is not None and n * len(rows) <= self.token_budget:
                out.append(n * len(rows))
        return out

    def _takes(self, budget: int | None) -> list[int]:
        """Each row's tokens in this chunk: up to the cap, its next snapshot length, its prompt's
        end."""
        cap = self.cap(len(self.rows), budget)
        takes = []
        for row in self.rows:
            pre = row.pre
            end = min(len(pre.prompt), pre.done + cap)
            pending = [s for s in pre.snapshot_at if pre.done < s < end]
            takes.append((pending[0] if pending else end) - pre.done)
        return takes

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, chunk length) a step can run at (none listed with exact shapes)."""
        if self.lengths is None:
            return []
        return [(rows, n) for rows in range(1, self.max_rows + 1) for n in self.lengths if n <= self.cap(rows)]

    def _inputs(self, n: int, takes: list[int]) -> tuple[mx.array, mx.array | None, mx.array]:
        """The chunk's token ids [B, n], embeddings (vision rows) and positions [3, B, n]; a row
        with fewer than n tokens left is padded at the right (token 0, positions counting on)."""
        ids_rows, pos_rows = [], []
        for row, take in zip(self.rows, takes, strict=True):
            pre = row.pre
            ids_rows.append(pre.prompt[pre.done:pre.done + take] + [0] * (n - take))
            pos = _positions(pre, pre.done + take)
            if take < n:
                after = pos[:, :, -1:] + mx.arange(1, n - take + 1, dtype=mx.int32)[None, None, :]
                pos = mx.concatenate([pos, after], axis=2)
            pos_rows.append(pos)
        ids = mx.array(ids_rows, dtype=mx.int32)
        positions = mx.concatenate(pos_rows, axis=1)
        if all(row.pre.embeds is None for row in self.rows):
            return ids, None, positions
        embeds = []
        for i, (row, take) in enumerate(zip(self.rows, takes, strict=True)):
            if row.pre.embeds is None:
                embeds.append(self.lm.model.embed_tokens(ids[i:i + 1]))
                continue
            emb = row.pre.embeds[:, row.pre.done:row.pre.done + take, :]
            if take < n:
                emb = mx.concatenate([emb, mx.zeros((1, n - take, emb.shape[2]), emb.dtype)], axis=1)
            embeds.append(emb)
        return ids, mx.concatenate(embeds, axis=0), positions

    def _snapshot(self, i: int) -> Snapshot:
        row = self.rows[i]
        target, nbytes = snapshot_caches([c.extract(i) for c in self._caches], row.pre.done)
        return Snapshot(length=row.pre.done, target=target, nbytes=nbytes)

    def _first_tokens(self, hidden: mx.array, finished: Sequence[int], takes: list[int]) -> mx.array:
        rows = mx.array(finished, dtype=mx.int32)
        cols = mx.array([takes[i] - 1 for i in finished], dtype=mx.int32)  # each row's last real token
        last = self.forward.share(hidden[rows, cols])[:, None, :]
        logits = self.forward.family.verify_logits(self.lm, last)[:, -1, :]
        rows = []
        for j, i in enumerate(finished):
            row_logits = logits[j:j + 1]
            pre = self.rows[i].pre
            for proc in self.rows[i].processors:
                row_logits = proc(mx.array(pre.prompt), row_logits)
            rows.append(row_logits)
        return mx.argmax(mx.concatenate(rows, axis=0), axis=-1).astype(mx.int32)

    def _release(self, finished: list[int], first: mx.array) -> Prefilled:
        rows = [self.rows[i] for i in finished]
        if len(finished) == len(self.rows):
            caches = self._caches
            mx.eval(first, [c.state for c in caches])
            self.rows, self._caches = [], []
            return Prefilled(rows, caches, first)
        caches = take_rows(self._caches, finished)
        self._keep([i for i in range(len(self.rows)) if i not in finished])
        mx.eval(first, [c.state for c in caches], [c.state for c in self._caches])
        return Prefilled(rows, caches, first)

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._caches = []
            return
        idx = mx.array(keep, dtype=mx.int32)
        for c in self._caches:
            c.filter(idx)

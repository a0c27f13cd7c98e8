"""The KV lane: continuous batching, prefix-cache restores and snapshots for a model served through its
library's own forward over attention KV caches (`models.library_kv`; GPU thread only).

The engine runs this lane in place of the plain lane (and of the library lane and the MTP lane)
for a model of no family of our own, e.g. any mlx-lm text model or mlx-vlm VLM whose layers keep
only keys and values:
- prefill: each joining row runs alone, chunk by chunk, through batch-1 library `KVCache`s, in
  arrival order within the step's prefill budget; a row restored from a prefix-cache snapshot
  starts from its keys and values (views, grown by copy on append) and prefills only the rest; a
  chunk stops at each of the row's snapshot lengths, where the snapshot is the keys and values up
  to there (an attention cache at length S is exactly the prompt's state at S; the prompt's end
  too, before the row joins the batch); an image row
  (Gemma 3) prefills from its prompt embeddings (`RowSpec.embeds`: the model's own embedding path,
  computed for the whole prompt when the row joins, `memory/features.py`), so a chunk or a
  snapshot may end inside an image (the library's forward is causal over image tokens too) and
  a row restored there prefills the rest of the image from the same embeddings;
- decode: the rows a prefill finishes join one batch of the library's left-padded `BatchKVCache`s
  (`merge` then `extend`), every decoding row one token per step through one forward; a row
  leaves with `filter`, its turn snapshot is `extract`. Each row's logits processors (grammar,
  penalties, its sampler last) run on its own logits; the argmax then is its token. Steps are
  double-buffered as `decode_batch.DecodeBatch`'s: step N's tokens are read at step N+1.

A row's first token comes out of the decode step after its prefill (as the plain lane's). A row
ends at end-of-sequence or max_tokens (reported in `LaneStep`) but stays in the batch until the
engine removes it, so its turn snapshot can still be taken. tests/test_families.py pins that
greedy tokens equal the library's plain decoding, alone, in ragged batches and restored from the
prefix cache (float32), and image rows mlx-vlm's own generate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from mlx_relay.engine.lane import LaneStep, RowSpec, RowTokens, sequence_end
from mlx_relay.engine.memory.batch_caches import extend_caches
from mlx_relay.engine.memory.snapshot_codec import CacheLayout, kv_layout
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.models.library_kv import KVModel


@dataclass
class _Row:
    spec: RowSpec
    caches: list[Any]  # batch-1 caches while prefilling; [] once the row decodes in the batch
    done: int = 0  # prompt tokens in `caches`
    snapshot_at: tuple[int, ...] = ()  # ascending lengths in (done, len(prompt)]
    cached_tokens: int = 0  # restored from the prefix cache
    emitted: int = 0


def _snapshot(caches: list[Any], length: int) -> Snapshot:
    """The keys and values of batch-1 caches up to `length` (views of the live buffers)."""
    entries: list[tuple[str, Any]] = []
    nbytes = 0
    for c in caches:
        if c.keys is None or c.offset < length:
            raise ValueError(f"a KV cache holding {c.offset} tokens cannot be snapshotted at {length}")
        entries.append(("kv", (c.keys[..., :length, :], c.values[..., :length, :])))
        nbytes += c.keys.nbytes + c.values.nbytes  # what the views keep alive
    return Snapshot(length=length, target=entries, nbytes=nbytes)


def _processed(logits: mx.array, processors: list[Any], last: int) -> mx.array:
    for proc in processors:
        logits = proc.process_last_token(last, logits) if hasattr(proc, "process_last_token") \
            else proc(mx.array([last]), logits)
    return logits


class KVLane:
    name: Literal["kv"] = "kv"

    def __init__(self, lm: Any, *, prefill_step_size: int, eos_token_ids: list[int]) -> None:
        self.model = KVModel(lm)
        self.eos = frozenset(eos_token_ids)
        self.prefill_step_size = max(1, prefill_step_size)
        self.rows: dict[int, _Row] = {}
        self._prefilling: list[int] = []  # in arrival order
        self._rids: list[int] = []  # decoding rows, in the batch caches' order
        self._caches: list[Any] = []  # the decoding rows' batch caches, per layer
        self._tokens: mx.array | None = None  # [B]: each decoding row's next token (maybe still computing)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def has_work(self) -> bool:
        return bool(self.rows)

    @property
    def decode_tokens(self) -> int:
        return len(self._rids)

    @property
    def prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def finishing_costs(self) -> list[int]:
        left = [len(self.rows[rid].spec.prompt) - self.rows[rid].done for rid in self._prefilling]
        return [n for n in left if n <= self.prefill_step_size]  # the rows one chunk can finish

    def add(self, spec: RowSpec) -> None:
        if spec.positions is not None:
            raise ValueError(f"{self.model.model_type} rows take no explicit positions (sparse prefill)")
        row = _Row(spec, self.model.new_caches())
        if spec.restore is not None:
            row.caches = self.model.restored(spec.restore.target)
            row.done = row.cached_tokens = spec.restore.length
            if row.done >= len(spec.prompt):  # at least the last token runs: its logits give the first token
                for c in row.caches:
                    c.trim(row.done - len(spec.prompt) + 1)
                row.done = row.cached_tokens = len(spec.prompt) - 1
        row.snapshot_at = tuple(sorted(s for s in spec.snapshot_at if row.done < s <= len(spec.prompt)))
        self.rows[spec.rid] = row
        self._prefilling.append(spec.rid)

    def cached_tokens(self, rid: int) -> int:
        row = self.rows.get(rid)
        return row.cached_tokens if row is not None else 0

    def remove(self, rid: int) -> None:
        if self.rows.pop(rid, None) is None:
            return
        if rid in self._prefilling:
            self._prefilling.remove(rid)
            return
        keep = [i for i, r in enumerate(self._rids) if r != rid]
        if not keep:
            self._rids, self._caches, self._tokens = [], [], None
            return
        assert self._tokens is not None
        mx.eval(self._tokens)
        idx = mx.array(keep, dtype=mx.int32)
        for c in self._caches:
            c.filter(idx)
        self._tokens = self._tokens[idx]
        self._rids = [self._rids[i] for i in keep]

    def clear(self) -> None:
        self.rows.clear()
        self._prefilling.clear()
        self._rids, self._caches, self._tokens = [], [], None

    def extract(self, rid: int) -> Snapshot | None:
        """The state of a decoding row: its prompt and every token it has emitted."""
        row = self.rows.get(rid)
        if row is None or rid not in self._rids:
            return None
        mx.eval(self._tokens)
        i = self._rids.index(rid)
        caches = [c.extract(i) for c in self._caches]
        length = len(row.spec.prompt) + row.emitted
        return _snapshot(caches, length) if caches[0].offset == length else None

    def close(self) -> None:
        pass

    def drafts(self, rid: int) -> None:
        return None

    def warm(self, vocab_size: int, max_rows: int) -> str:
        return ""  # the library's forward over its caches traces nothing ahead

    def cache_layout(self) -> CacheLayout:
        """What a snapshot file of this model must hold (the disk tier's check): one token through
        fresh caches; every layer an attention layer."""
        caches = self.model.new_caches()
        self.model.forward(mx.array([[0]], dtype=mx.int32), caches)
        mx.eval([(c.keys, c.values) for c in caches])
        return CacheLayout(tuple(kv_layout(c.keys[..., :1, :], c.values[..., :1, :]) for c in caches), None, None)

    # -- the step ---------------------------------------------------------------------------
    def step(self, prefill_budget: int | None = None) -> LaneStep:
        """One decode step of the decoding rows, then prefill chunks of the joining rows, at most
        `prefill_budget` tokens in all (the rows it finishes join the decode batch; their first
        tokens come out of its next step)."""
        out = LaneStep()
        if self._rids:
            inputs = self._tokens
            assert inputs is not None
            self._tokens = self._next(inputs)
            mx.async_eval(self._tokens)
            for rid, token in zip(self._rids, inputs.tolist(), strict=True):
                row = self.rows[rid]
                row.emitted += 1
                out.tokens.append(RowTokens(rid, [token], sequence_end(token, row.emitted, row.spec.max_tokens,
                                                                    self.eos)))
        if self._prefilling:
            self._prefill(self.prefill_step_size if prefill_budget is None
                          else max(1, min(prefill_budget, self.prefill_step_size)), out)
        return out

    def _next(self, inputs: mx.array) -> mx.array:
        logits = self.model.forward(inputs[:, None], self._caches)[:, -1, :]
        rows = [self.rows[rid].spec.processors for rid in self._rids]
        if any(rows):
            last = inputs.tolist()
            logits = mx.concatenate([_processed(logits[i:i + 1], procs, last[i]) for i, procs in enumerate(rows)])
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def _prefill(self, budget: int, out: LaneStep) -> None:
        ran: set[int] = set()
        while self._prefilling and budget > 0:
            rid = self._prefilling[0]
            row = self.rows[rid]
            prompt, embeds = row.spec.prompt, row.spec.embeds
            end = min(len(prompt), row.done + budget)
            end = next((s for s in row.snapshot_at if row.done < s < end), end)
            ids = mx.array([prompt[row.done:end]], dtype=mx.int32)
            logits = self.model.forward(ids, row.caches, None if embeds is None else embeds[:, row.done:end, :])
            budget -= end - row.done
            out.prefill_tokens += end - row.done
            ran.add(rid)
            row.done = end
            if end in row.snapshot_at:
                out.snapshots.append((rid, _snapshot(row.caches, end)))
            if row.done < len(prompt):
                mx.eval([(c.keys, c.values) for c in row.caches])
                continue
            self._prefilling.pop(0)
            first = mx.argmax(_processed_prompt(logits[:, -1, :], row.spec.processors, prompt), axis=-1)
            self._join(rid, row, first.astype(mx.int32))
        out.prefill_rows = len(ran)

    def _join(self, rid: int, row: _Row, first: mx.array) -> None:
        merged = [self.model.batch_cache.merge([c]) for c in row.caches]
        row.caches = []
        if not self._rids:
            self._caches, tokens = merged, first
        else:
            assert self._tokens is not None
            mx.eval(self._tokens)  # settle the pending step first
            extend_caches(self._caches, merged)
            tokens = mx.concatenate([self._tokens, first])
        self._rids.append(rid)
        self._tokens = tokens
        mx.eval(self._tokens, [(c.keys, c.values) for c in self._caches])


def _processed_prompt(logits: mx.array, processors: list[Any], prompt: list[int]) -> mx.array:
    """The first token's logits through the row's processors (which see the whole prompt)."""
    for proc in processors:
        logits = proc(mx.array(prompt), logits)
    return logits

"""mlx-vlm's `BatchGenerator` behind our lane interface (GPU thread only).

The library's generator prefills up to `prefill_batch_size` joining rows *together* (ragged
prompts, one forward per chunk), which pays at high concurrency: with the prefix cache off it
served 64 streams at 1.37x the throughput of our one-row-at-a-time prefill on an H200 (issue 17's
measurement). It cannot restore or snapshot a row, so the engine uses it only when the prefix
cache is off. The generator numbers its rows itself; this adapter maps them to ours. It ends a
row itself at end-of-sequence or max_tokens (and drops it), which the lane reports as the row's
ending; removing such a row afterwards is a no-op.
"""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
from mlx_vlm.generate.ar import BatchGenerator

from mlx_relay.engine.lane import LaneStep, RowSpec, RowTokens
from mlx_relay.engine.memory.snapshots import Snapshot


class LibraryLane:
    name: Literal["library"] = "library"

    def __init__(self, model: Any, processor: Any, *, max_num_seqs: int, prefill_batch_size: int,
                 prefill_step_size: int) -> None:
        self._model = model
        self._processor = processor
        self._sizes = (max_num_seqs, min(prefill_batch_size, max_num_seqs), prefill_step_size)
        self._gen = self._new_generator()
        self._uid_of: dict[int, int] = {}  # our row -> the generator's uid
        self._rid_of: dict[int, int] = {}

    def _new_generator(self) -> BatchGenerator:
        # The generator admits new prompts only while `completion_batch_size - running` is at
        # least `prefill_batch_size`; we bound running rows ourselves, so give it that headroom
        # (pinned by tests/test_library_adapters.py).
        max_num_seqs, prefill_batch, prefill_step = self._sizes
        return BatchGenerator(self._model.language_model, self._processor,
                              completion_batch_size=max_num_seqs + prefill_batch, prefill_batch_size=prefill_batch,
                              prefill_step_size=prefill_step, compute_logprobs=False, greedy_sampling=True)

    def __len__(self) -> int:
        return len(self._uid_of)

    @property
    def has_work(self) -> bool:
        return bool(self._uid_of)

    @property
    def decode_tokens(self) -> int:
        return len(self._uid_of)

    @property
    def prefilling(self) -> int:
        return 0  # the generator prefills at its own chunk size (the engine caps it at the budget)

    @property
    def finishing_costs(self) -> list[int]:
        return []

    def add(self, spec: RowSpec) -> None:
        kwargs = spec.prompt_kwargs
        if kwargs is None:
            embed = self._model.get_input_embeddings(mx.array([spec.prompt]), None)
            kwargs = {k: v for k, v in embed.to_dict().items() if v is not None}
        (uid,) = self._gen.insert([spec.prompt], max_tokens=[spec.max_tokens], prompt_kwargs=[kwargs],
                                  logits_processors=[spec.processors])
        self._uid_of[spec.rid], self._rid_of[uid] = uid, spec.rid

    def cached_tokens(self, rid: int) -> int:
        return 0

    def extract(self, rid: int) -> Snapshot | None:
        return None  # the library keeps no row state we could copy

    def remove(self, rid: int) -> None:
        uid = self._uid_of.pop(rid, None)
        if uid is not None:
            del self._rid_of[uid]
            self._gen.remove(uid)

    def clear(self) -> None:
        self._gen.close()
        self._gen = self._new_generator()
        self._uid_of.clear()
        self._rid_of.clear()

    def close(self) -> None:
        self._gen.close()

    def drafts(self, rid: int) -> None:
        return None

    def cache_layout(self) -> None:
        return None  # mlx-vlm's generator keeps its rows' caches: no snapshots

    def warm(self, vocab_size: int, max_rows: int) -> str:
        return ""

    def step(self, prefill_budget: int | None = None) -> LaneStep:
        """One `next()` of the generator: a decode step of its rows, then (decode first, as our
        lanes) one prompt chunk of its joining rows at its own chunk size; `prefill_budget` is
        not the generator's to take."""
        out = LaneStep()
        _, responses = self._gen.next()
        for r in responses:
            rid = self._rid_of.get(r.uid)
            if rid is None:
                continue
            ended = None
            if r.finish_reason is not None:  # the generator dropped the row
                ended = "length" if r.finish_reason == "length" else "stop"
                del self._rid_of[r.uid], self._uid_of[rid]
            out.tokens.append(RowTokens(rid, [r.token], ended))
        return out

"""A draft model's proposals through the engine's compiled decode step (GPU thread only; issue 45.1).

`draft_model.DraftProposals` runs the draft's library forward eagerly, once a drafted token and
again over the committed tokens each round: on an H200 a 4-layer draft's round of 8 drafts took
~60 ms, so the draft model decoded at 0.48x plain (`benchmarks/results/gpu-h200-2026-11-29/`).
For a draft of a family the engine serves (`models.family_of`: Qwen3.5, Qwen3), `CompiledDraftProposals`
drafts through `lanes.decode_step.DecodeStep` instead, the plain lane's step as one traced function
(one compiled call a drafted token, no graph built in Python), over the row's caches made explicit
(`lanes.decode_state.DecodeState`, one row):

- the prompt is read once through the family's prefill forward over the library's caches
  (`DraftModel.read`; `proposer.FEED_CHUNK` tokens a round at most), its caches then taken into a
  `DecodeState`;
- a round's steps keep the state after each (the attention write column and the recurrent layers'
  arrays: values, so keeping them costs nothing); the next round finds how many of its drafts the
  row committed and goes back to the state after the last of them it kept, so the committed
  drafts are never read twice; only what the draft did not read (the target's own token, and the
  last draft when all were taken) is stepped, as the round's first inputs. Attention columns past
  the kept column are masked by the step and written over.

Greedy output is the target's either way (the round verifies the drafts); the float32 tests pin
that a model drafting for itself through this path is right every time (`tests/test_draft_model.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_relay.engine.lanes.decode_state import DecodeState
from mlx_relay.engine.lanes.decode_step import DecodeStep
from mlx_relay.engine.scoring.draft_library import make_cache
from mlx_relay.engine.speculation.earnings import Source
from mlx_relay.engine.speculation.proposer import FEED_CHUNK

if TYPE_CHECKING:
    from mlx_relay.engine.speculation.draft_model import DraftModel



class CompiledDraftProposals:
    """One row's drafts through the compiled step (the proposer protocol: `source`, `ready`, `propose`,
    `extend`)."""

    source: Source = "draft"
    costly = True  # made only for a round that verifies it (`round_drafts.RoundDrafts.plan`)

    def __init__(self, model: DraftModel, step: DecodeStep, tokens: list[int]) -> None:
        self._model = model
        self._step = step
        self._pending = list(tokens)  # committed, not yet read by the draft
        self._cache: list[Any] | None = make_cache(model.model)  # the library's, until the prompt is read
        self._state: DecodeState | None = None
        self._drafts: list[int] = []  # the last round's drafts
        self._kept: list[tuple[int, list[mx.array], list[mx.array]]] = []  # after each of its steps

    def extend(self, tokens: list[int]) -> None:
        """The row committed `tokens`."""
        self._pending.extend(tokens)

    def ready(self) -> bool:
        """Whether a proposal reads at most `FEED_CHUNK` tokens of the prompt; if not, the draft
        reads that many now (its caches evaluated) and the row has no proposal this round."""
        if self._cache is None or len(self._pending) <= FEED_CHUNK:
            return True
        self._pending = self._model.read_chunk(self._pending, self._cache)
        return False

    def propose(self, n: int) -> list[int]:
        """Up to `n` drafts (at most the model's `tokens`) after the row's committed tokens."""
        n = min(n, self._model.info.tokens)
        if n <= 0 or not self._pending:
            return []
        state = self._catch_up()
        token = mx.array(self._pending[-1:], dtype=mx.int32)
        self._pending = []
        drafts: list[mx.array] = []
        self._kept = []
        for _ in range(n):
            token = mx.argmax(self._step(token, state), axis=-1).astype(mx.int32)
            drafts.append(token)
            self._kept.append((state.idx, state.conv, state.ssm))
        self._drafts = [int(t) for t in mx.concatenate(drafts).tolist()]
        return list(self._drafts)

    def _catch_up(self) -> DecodeState:
        """The state that has read every committed token but the last (the round's first input)."""
        if self._state is None:
            assert self._cache is not None
            if len(self._pending) > 1:
                self._model.read(self._pending[:-1], self._cache)
            self._state = DecodeState.from_row_caches(self._cache, self._step.layout)
            self._cache = None
            del self._pending[:-1]
            return self._state
        state = self._state
        taken = 0  # the last round's drafts the row committed, in order
        while taken < min(len(self._drafts), len(self._pending)) and self._pending[taken] == self._drafts[taken]:
            taken += 1
        if self._kept:
            # the state after step s read the round's first input and its drafts 1..s; at least one
            # committed token is left to be the round's first input
            s = min(taken, len(self._kept) - 1, len(self._pending) - 1)
            state.idx, state.conv, state.ssm = self._kept[s]
            del self._pending[:s]
        self._kept, self._drafts = [], []
        for t in self._pending[:-1]:  # what the draft has not read (a draft taken past the kept states)
            self._step(mx.array([t], dtype=mx.int32), state)
        del self._pending[:-1]
        return state

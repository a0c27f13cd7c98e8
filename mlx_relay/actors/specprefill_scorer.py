"""SpecPrefillScorer: decides which tokens of a long prompt the target prefills.

    ChatService --Select--> scorer: due? (the uncached part's length against the threshold, or the
        request's own override) -- not due: Selection(None) at once
    scorer --ScorePrompt--> GPUExecutor: the draft model scores the uncached tokens, one chunk per
        engine step (other requests keep decoding meanwhile)
    GPUExecutor --PromptScored--> scorer: scores (or the error) -> chunk selection
        (`specprefill.selection`) -> Selection(SparsePrefill, report) to the waiting request,
        which hands it to the GPUExecutor inside its `Generate`

The draft model (`SpecPrefillConfig.draft_model`, same tokenizer as the target) is loaded on the
GPU thread when the actor starts. The actor never waits on the GPU inside a handler: a request
being scored is held by its reply stream until its PromptScored arrives, so short requests are
answered while a long one is scored. Anything that goes wrong with scoring (the draft fails, the
scores are not finite, the lengths disagree) falls back to a normal prefill for that request:
the Selection is then `None` with a report that says why, and the failure is counted.
"""

from __future__ import annotations

import msgspec

from mlx_relay.config import SpecPrefillConfig
from mlx_relay.engine.messages import (
    CancelScoring,
    DraftInfo,
    LoadDraft,
    PromptScored,
    ScorePrompt,
    SparsePrefill,
    SpecPrefillReport,
)
from mlx_relay.runtime import Actor, ActorRef, ReplyStream
from mlx_relay.specprefill.selection import select_chunks


class Select(msgspec.Struct, frozen=True):
    """Stream request: what the target prefills of `tokens`. Reply: one Selection.

    `restored`: the prompt tokens the prefix cache restores (never scored). `snapshot_at`: the
    prompt lengths the prefix cache wants exact snapshots at; the ones that still leave a long
    enough part to score (e.g. a system prompt's end) stay exact, later ones (e.g. the reply's
    header, for the conversation's next turn) are given up for the sparse prefill.
    `enabled`: the request's override (None: by the threshold). `keep_fraction`: its own."""

    request_id: str
    tokens: list[int]
    restored: int = 0
    snapshot_at: list[int] = []
    enabled: bool | None = None
    keep_fraction: float | None = None


class Selection(msgspec.Struct, frozen=True):
    sparse: SparsePrefill | None  # None: prefill every token
    report: SpecPrefillReport | None  # None: SpecPrefill was neither due nor asked for


class GetSpecPrefillStats(msgspec.Struct, frozen=True):
    """Ask. Reply: SpecPrefillStats."""


class SpecPrefillStats(msgspec.Struct, frozen=True):
    draft_model: str
    threshold: int
    chunk_size: int
    keep_fraction: float
    sparse_requests: int  # prefilled sparsely
    fallbacks: int  # due, but scoring failed: prefilled normally
    tokens_scored: int
    tokens_kept: int
    scoring_seconds: float  # GPU-thread time from first draft chunk to scores, summed
    last_error: str | None = None


class _Pending(msgspec.Struct):
    stream: ReplyStream
    select: Select
    dense_end: int  # the positions before it are kept without scoring
    keep: float


class SpecPrefillScorer(Actor):
    accepts = (Select, PromptScored, GetSpecPrefillStats)
    mailbox_capacity = 4096  # every PromptScored must fit: far more than requests in flight

    def __init__(self, config: SpecPrefillConfig, gpu: ActorRef) -> None:
        if config.draft_model is None:
            raise ValueError("SpecPrefillScorer needs a draft model")
        self.config = config
        self.gpu = gpu
        self.draft: DraftInfo | None = None
        self._pending: dict[str, _Pending] = {}
        self._sparse = self._fallbacks = self._scored = self._kept = 0
        self._seconds = 0.0
        self._last_error: str | None = None

    async def on_start(self) -> None:
        from mlx_relay.actors.gpu_executor import AttachScorer

        assert self.config.draft_model is not None
        self.draft = await self.gpu.ask(LoadDraft(self.config.draft_model))
        await self.gpu.tell(AttachScorer(self.ref))

    async def receive(self, msg: Select | PromptScored | GetSpecPrefillStats, stream: ReplyStream | None) -> object:
        match msg:
            case Select():
                assert stream is not None
                await self._select(msg, stream)
                return None
            case PromptScored():
                self._scored_prompt(msg)
                return None
            case GetSpecPrefillStats():
                c = self.config
                return SpecPrefillStats(str(c.draft_model), c.threshold, c.chunk_size, c.keep_fraction, self._sparse,
                                        self._fallbacks, self._scored, self._kept, round(self._seconds, 4),
                                        self._last_error)
        raise TypeError(type(msg).__name__)

    def on_cancel(self, stream: ReplyStream) -> None:
        for rid, pending in list(self._pending.items()):
            if pending.stream.id == stream.id:
                del self._pending[rid]
                self.gpu.tell_nowait(CancelScoring(rid))

    def _dense_end(self, msg: Select) -> int:
        """Where the scored part starts: after the restored prefix and after each snapshot point
        that still leaves enough to score (the threshold; when forced, more than two chunks)."""
        c = self.config
        least = c.threshold if msg.enabled is None else 2 * c.chunk_size + 1
        points = [s for s in msg.snapshot_at if len(msg.tokens) - s >= least]
        return max([msg.restored, *points])

    async def _select(self, msg: Select, stream: ReplyStream) -> None:
        c = self.config
        dense = self._dense_end(msg)
        n = len(msg.tokens) - dense
        due = msg.enabled if msg.enabled is not None else n >= c.threshold
        if not due or n <= 0:
            _answer(stream, Selection(None, None))
            return
        keep = msg.keep_fraction if msg.keep_fraction is not None else c.keep_fraction
        if keep >= 1.0:  # nothing to drop: the sparse path with every position (no scoring)
            self._count(0, n, 0.0)
            _answer(stream, Selection(SparsePrefill([(0, len(msg.tokens))]),
                                      SpecPrefillReport(True, 0, n, keep)))
            return
        if n <= 2 * c.chunk_size:  # first and last chunk are always kept: nothing could be dropped
            _answer(stream, Selection(None, SpecPrefillReport(
                False, 0, n, keep, fallback=f"the uncached prompt ({n} tokens) is within two chunks")))
            return
        self._pending[msg.request_id] = _Pending(stream, msg, dense, keep)
        await self.gpu.tell(ScorePrompt(msg.request_id, msg.tokens[dense:], c.query_window))

    def _scored_prompt(self, out: PromptScored) -> None:
        pending = self._pending.pop(out.request_id, None)
        if pending is None:  # the request left meanwhile
            return
        sel, keep, dense = pending.select, pending.keep, pending.dense_end
        n = len(sel.tokens) - dense
        error = out.error
        if error is None and len(out.scores) != n:
            error = f"the draft returned {len(out.scores)} scores for {n} tokens"
        if error is not None:
            self._fallbacks += 1
            self._last_error = error
            _answer(pending.stream, Selection(None, SpecPrefillReport(False, 0, n, keep, fallback=error)))
            return
        sparse = select_chunks(out.scores, start=dense, chunk_size=self.config.chunk_size, keep_fraction=keep)
        kept = sparse.kept - dense
        self._count(n, kept, out.seconds)
        _answer(pending.stream, Selection(sparse, SpecPrefillReport(True, n, kept, keep)))

    def _count(self, scored: int, kept: int, seconds: float) -> None:
        self._sparse += 1
        self._scored += scored
        self._kept += kept
        self._seconds += seconds


def _answer(stream: ReplyStream, selection: Selection) -> None:
    stream.send(selection)
    stream.close()

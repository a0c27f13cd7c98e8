"""A draft model's proposals: the MTP lane's third source of drafts, beside the head's and the
context's (GPU thread only; `--draft-model PATH`, per request `speculation.method: "draft"`).

A small checkpoint with the target's vocabulary (`DraftModel.load`: any family mlx-lm or mlx-vlm
loads, through `scoring.draft_library`, as SpecPrefill's draft) proposes each round's drafts for a
row greedily from the row's tokens so far. The round verifies them as it verifies drafts copied
from the context (host drafts: a point-mass proposal, so greedy output is plain decoding's and a
sampling row's distribution is the target's, as `tests/test_context_drafts.py` pins for that
path); `round_drafts.RoundDrafts` weighs them by what they earn (`earnings`, source `"draft"`).

Each row keeps its own draft caches (`DraftProposals`), in step with its committed tokens: a
round's `propose` first puts the caches back where the last committed token left them (attention
caches trimmed to their length, the recurrent layers' states the arrays kept then: MLX arrays
are values, and the libraries replace a recurrent state rather than write into it), feeds the
tokens committed since (`extend`: the verified drafts and the target's token after them) in one
forward, keeps that state, and then drafts token after token. A draft costs one small forward;
the draft's caches are not counted in the KV budget (a small model's, one per row of the lane).
A draft of a family the engine serves drafts through its compiled decode step instead
(`draft_compiled.CompiledDraftProposals`: one traced call a drafted token, the committed drafts
never read twice); this eager path stays for every other family and for `compiled=False`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache as LmArraysCache
from mlx_vlm.models.cache import ArraysCache as VlmArraysCache

from mlx_relay.engine.lanes.decode_step import DecodeStep, UnsupportedModel
from mlx_relay.engine.models.positions import text_positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.scoring.draft_library import (
    LoadedDraft,
    cache_arrays,
    is_attention_cache,
    load_draft,
    make_cache,
)
from mlx_relay.engine.speculation.draft_compiled import CompiledDraftProposals
from mlx_relay.engine.speculation.earnings import Source
from mlx_relay.engine.speculation.proposer import FEED_CHUNK
from mlx_relay.errors import ModelLoadError


class DraftModelIncompatible(ModelLoadError):
    """The draft model cannot draft for the served model: another vocabulary (its token ids mean
    other text), or a layer whose cache it cannot put back a round (a sliding window)."""


def _restorable(cache: Any) -> bool:
    """A cache `DraftProposals` puts back: a full-attention KV cache (trimmed) or a recurrent
    layer's arrays (replaced whole by the library's forward, so the arrays kept are intact)."""
    return is_attention_cache(cache) or isinstance(cache, (LmArraysCache, VlmArraysCache))


def _vocabulary(tokenizer: Any) -> dict[str, int]:
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    get_vocab = getattr(inner, "get_vocab", None)
    return dict(get_vocab()) if get_vocab is not None else {}


@dataclass(frozen=True)
class DraftModelInfo:
    path: str
    model_type: str
    library: str
    tokens: int  # drafts a round at most
    compiled: bool  # drafts through the engine's compiled decode step (else the library's eager forward)


class DraftModel:
    """The loaded draft (GPU thread only): `proposals(tokens)` starts a row's."""

    def __init__(self, loaded: LoadedDraft, path: Path, tokens: int, compiled: bool = True,
                 prefill_options: PrefillOptions | None = None) -> None:
        if tokens < 1:
            raise ValueError("a draft model proposes at least one token a round")
        self.model = loaded.model
        self.prefill_options = prefill_options or PrefillOptions()
        self.step: DecodeStep | None = None
        if compiled:
            try:  # a family the engine's decode step serves
                self.step = DecodeStep(self.model)
            except UnsupportedModel:
                self.step = None
        self.info = DraftModelInfo(str(path), loaded.model_type, loaded.library, tokens, self.step is not None)
        kinds = {type(c).__name__ for c in make_cache(self.model) if not _restorable(c)}
        if kinds:
            raise DraftModelIncompatible(f"the draft model {path} has layers whose caches a round cannot put "
                                         f"back ({', '.join(sorted(kinds))})")
        try:  # its forward over a prompt and a token, as a row's drafts run it (a failure here, not mid-step)
            cache = make_cache(self.model)
            mx.eval(self.forward(mx.array([[0, 1]], dtype=mx.int32), cache))
            mx.eval(self.forward(mx.array([[2]], dtype=mx.int32), cache))
        except Exception as exc:
            raise DraftModelIncompatible(f"the draft model {path} cannot run a row's drafts: {exc!r}") from exc
        if self.step is not None:
            try:  # and a row's round through the compiled step; if it cannot run, the eager forward drafts
                self.proposals([0, 1, 2]).propose(2)
            except Exception:
                self.step = None
                self.info = DraftModelInfo(str(path), loaded.model_type, loaded.library, tokens, False)

    @classmethod
    def load(cls, path: Path, target_tokenizer: Any, tokens: int, compiled: bool = True,
             prefill_options: PrefillOptions | None = None) -> DraftModel:
        """The draft at `path`; `ModelLoadError` if it cannot be loaded, `DraftModelIncompatible`
        if it cannot draft for the target (`target_tokenizer`'s vocabulary); `compiled`: through the
        engine's compiled decode step where its family is served (and its prompts read through the
        family's prefill, run as `prefill_options` say: the engine's)."""
        try:
            loaded = load_draft(path)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the draft model {path}: {exc}") from exc
        mine, theirs = _vocabulary(loaded.tokenizer), _vocabulary(target_tokenizer)
        if not mine or mine != theirs:
            raise DraftModelIncompatible(f"the draft model {path} has another vocabulary than the served model "
                                          f"({len(mine)} tokens against {len(theirs)})")
        return cls(loaded, path, tokens, compiled, prefill_options)

    def proposals(self, tokens: list[int]) -> DraftProposals | CompiledDraftProposals:
        """A row's proposer, its tokens so far `tokens` (read at its first proposal)."""
        if self.step is not None:
            return CompiledDraftProposals(self, self.step, tokens)
        return DraftProposals(self, tokens)

    def read_chunk(self, tokens: list[int], cache: list[Any]) -> list[int]:
        """`FEED_CHUNK` of a row's unread `tokens` read into its `cache` (evaluated); the rest."""
        self.read(tokens[:FEED_CHUNK], cache)
        mx.eval(cache_arrays(cache))
        return tokens[FEED_CHUNK:]

    def read(self, tokens: list[int], cache: list[Any]) -> None:
        """A row's committed `tokens` read into its `cache` (no logits: the drafts start from the
        next step). A draft of a family the engine serves reads them through the family's prefill
        forward, as the target reads its prompts (its kernels on a GPU, its recurrence on the CPU,
        over the library's caches kept as the library keeps them); where the library's own forward
        ran them, its chunked GatedDeltaNet prefill padded each call to 64 tokens and solved it in
        sequential steps off Metal (on this CPU 30% of a test's time, 200 rows of a 30-token prompt).
        Any other draft: the library's forward."""
        ids = mx.array([tokens], dtype=mx.int32)
        if self.step is None:
            self.forward(ids, cache)
            return
        start = next((c.offset for c in cache if is_attention_cache(c)), 0)
        self.step.family.prefill_forward(self.step.lm, ids, None, cache, text_positions(start, start + len(tokens)),
                                         self.prefill_options)

    def forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """The draft's logits [1, T, V] over `tokens` [1, T], its caches advanced."""
        out = self.model(tokens, cache=cache)
        return out if isinstance(out, mx.array) else out.logits


class DraftProposals:
    """One row's drafts (the `round_drafts` proposer protocol: `source`, `propose`, `extend`)."""

    source: Source = "draft"
    costly = True  # made only for a round that verifies it (`round_drafts.RoundDrafts.plan`)

    def __init__(self, model: DraftModel, tokens: list[int]) -> None:
        self._model = model
        self._cache = make_cache(model.model)
        self._pending = list(tokens)  # committed, not yet read by the draft
        self._kept: list[Any] | None = None  # the caches' state at the last committed token

    def extend(self, tokens: list[int]) -> None:
        """The row committed `tokens`."""
        self._pending.extend(tokens)

    def ready(self) -> bool:
        """Whether a proposal reads at most `FEED_CHUNK` tokens; if not, the draft reads that many of
        them now (its caches evaluated) and the row has no proposal this round."""
        if len(self._pending) <= FEED_CHUNK:
            return True
        self._rewind()
        self._pending = self._model.read_chunk(self._pending, self._cache)
        self._keep()
        return False

    def propose(self, n: int) -> list[int]:
        """Up to `n` drafts (at most the model's `tokens`) after the row's committed tokens (those not
        read yet, at most `FEED_CHUNK` after `ready`, read first in one forward)."""
        n = min(n, self._model.info.tokens)
        if n <= 0 or not self._pending:
            return []
        self._rewind()
        logits = None
        for start in range(0, len(self._pending), FEED_CHUNK):
            chunk = mx.array([self._pending[start:start + FEED_CHUNK]], dtype=mx.int32)
            logits = self._model.forward(chunk, self._cache)
        assert logits is not None
        self._pending = []
        self._keep()
        drafts = [mx.argmax(logits[:, -1, :], axis=-1)]
        for _ in range(n - 1):
            logits = self._model.forward(drafts[-1][:, None], self._cache)
            drafts.append(mx.argmax(logits[:, -1, :], axis=-1))
        return [int(t) for t in mx.concatenate(drafts).tolist()]

    def _keep(self) -> None:
        self._kept = [c.offset if is_attention_cache(c) else list(c.state) for c in self._cache]

    def _rewind(self) -> None:
        """The caches back at the last committed token (the drafts past it dropped)."""
        if self._kept is None:
            return
        for cache, kept in zip(self._cache, self._kept, strict=True):
            if is_attention_cache(cache):
                cache.trim(cache.offset - kept)
            else:
                cache.state = kept

"""Messages to and from the GPUExecutor actor (typed, msgspec).

No MLX array ever appears here: prompts travel as token ids, results as text and token ids.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from mlx_relay.chat.output import TokenLogprob
from mlx_relay.media.tensors import VisionInputs
from mlx_relay.specprefill.report import SpecPrefillReport

__all__ = ["SpecPrefillReport"]  # re-exported: engine messages carry it

FinishReason = Literal["stop", "length"]


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Per-request sampling. temperature == 0 is greedy (exact argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    mtp: bool = True  # MTP speculative decoding when the text path has it (per-request opt-out)
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the k most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    grammar: str | None = None  # llguidance grammar (validated before the request was admitted)
    grammar_after_thinking: bool = False  # the grammar applies once the thinking block is closed
    think_open: bool = False  # the prompt leaves a thinking block open
    thinking_budget: int | None = None  # at most this many thinking tokens (then the block is closed)

    @property
    def needs_processors(self) -> bool:
        """Anything beyond plain sampling: such rows decode in the plain lane."""
        return (self.logprobs >= 0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty not in (None, 1.0) or self.grammar is not None
                or self.thinking_budget is not None)


class PrefixPlan(msgspec.Struct, frozen=True):
    """What the PrefixCacheStore decided for one request (the handles are the GPU executor's)."""

    restore: int | None = None  # snapshot handle to start from (pinned by the store meanwhile)
    restore_length: int = 0  # prompt tokens that snapshot covers
    snapshot_at: list[int] = []  # prompt lengths to snapshot during prefill (e.g. the system prompt's end)
    snapshot_turn: bool = False  # snapshot the whole state when the request finishes normally


class SparsePrefill(msgspec.Struct, frozen=True):
    """The prompt positions the target prefills: ascending, disjoint [start, end) ranges; every
    position before `ranges[0][1]` (the cached prefix and any snapshot point) is kept."""

    ranges: list[tuple[int, int]]

    @property
    def kept(self) -> int:
        return sum(b - a for a, b in self.ranges)


class Generate(msgspec.Struct, frozen=True):
    """Stream request: generate from a tokenized prompt. Replies: TokenDelta..., Finished."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams = SamplingParams()
    vision: VisionInputs | None = None  # images / video, preprocessed off the GPU (vision path)
    prefix: PrefixPlan | None = None  # None: the prefix cache is off for this request
    sparse: SparsePrefill | None = None  # SpecPrefill's selection (None: prefill every token)
    specprefill: SpecPrefillReport | None = None  # echoed in Finished


class SnapshotTaken(msgspec.Struct, frozen=True):
    """Engine event (not sent to the request's stream): a snapshot of `request_id`'s state now
    exists on the GPU thread. `generated`: the completion tokens it covers beyond the prompt."""

    request_id: str
    handle: int
    length: int
    nbytes: int
    kind: Literal["system", "turn"]
    generated: list[int] = []


class FreeSnapshots(msgspec.Struct, frozen=True):
    """Tell: drop these snapshots (evicted or rejected by the PrefixCacheStore). `release_memory`
    (a flush): also hand MLX's cache of freed buffers back (otherwise kept for reuse)."""

    handles: list[int]
    release_memory: bool = False


class TokenDelta(msgspec.Struct, frozen=True):
    """New text (UTF-8 safe: never half a character) and the tokens behind it; their
    log-probabilities when the request asked for them."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class Finished(msgspec.Struct, frozen=True):
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    # time from arrival at the GPU thread to the first token, and to the end (seconds)
    ttft_s: float = 0.0
    total_s: float = 0.0
    # MTP speculative decoding on this request: draft tokens proposed and accepted (0 / 0: off)
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (not prefilled)
    specprefill: SpecPrefillReport | None = None  # when SpecPrefill ran or was due for the request


class LoadDraft(msgspec.Struct, frozen=True):
    """Ask: load SpecPrefill's draft model on the GPU thread (its tokenizer must be the target's).
    Reply: DraftInfo."""

    path: str


class DraftInfo(msgspec.Struct, frozen=True):
    path: str
    model_type: str
    attention_layers: int  # layers whose attention the scores are read from
    load_seconds: float


class ScorePrompt(msgspec.Struct, frozen=True):
    """Tell (SpecPrefillScorer -> GPUExecutor): score each token of `tokens` with the draft model
    (the attention of the last `window` query positions), chunk by chunk between engine steps.
    The result goes to the attached scorer as a PromptScored."""

    request_id: str
    tokens: list[int]
    window: int = 16


class CancelScoring(msgspec.Struct, frozen=True):
    """Tell: the request left; drop its scoring job."""

    request_id: str


class PromptScored(msgspec.Struct, frozen=True):
    """Engine event (GPUExecutor -> SpecPrefillScorer): one scoring job's outcome."""

    request_id: str
    scores: list[float] = []  # one per token, finite, >= 0 (empty on error)
    seconds: float = 0.0  # on the GPU thread, from the first chunk to the scores
    error: str | None = None  # why scoring failed (the request then prefills normally)


class Describe(msgspec.Struct, frozen=True):
    """Ask: what is loaded. Reply: ModelInfo."""


class GetEngineStats(msgspec.Struct, frozen=True):
    """Ask: counters of the engine. Reply: EngineStats."""


class EngineStats(msgspec.Struct, frozen=True):
    running: int
    waiting: int
    vision_cache_hits: int
    vision_cache_misses: int
    vision_cache_entries: int
    vision_cache_bytes: int
    mtp_running: int = 0  # rows decoding with MTP now
    mtp_rounds: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    snapshots: int = 0  # prefix-cache snapshots held on the GPU thread
    snapshot_bytes: int = 0
    scoring: int = 0  # SpecPrefill scoring jobs queued or running


class Warmup(msgspec.Struct, frozen=True):
    """Ask: run the kernels the server will use once, so the first request does not wait."""


class ModelInfo(msgspec.Struct, frozen=True):
    model_path: str
    model_type: str
    backend: Literal["metal", "cuda", "cpu"]
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    has_vision: bool
    has_mtp: bool
    load_seconds: float
    prefix_cache_bytes: int = 0  # the prefix cache's byte budget (0: off)

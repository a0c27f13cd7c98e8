"""Messages of the GPUExecutor (`actors/gpu_executor.py`), the one actor that runs MLX: a request
to generate (with every plan the policy actors made for it), the reply stream's items, and what
is loaded and counted on the GPU thread."""

from __future__ import annotations

from typing import Literal

import msgspec

from mlx_relay.cache.snapshot_files import SnapshotIdentity
from mlx_relay.chat.output import Drafts, TokenLogprob
from mlx_relay.config import SpeculationMethod
from mlx_relay.media.tensors import VisionInputs
from mlx_relay.messages.prefix_cache import PrefixPlan
from mlx_relay.messages.specprefill import ScorePlan, SparsePrefill, SpecPrefillReport

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
    mtp: bool = True  # the request allows MTP speculative decoding (the TextMTPExecutor decides)
    speculation: SpeculationMethod | None = None  # None: the server's default (`EngineConfig.speculation`)
    max_draft_tokens: int | None = None  # context drafts per round at most (None: the server's; capped by it)
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and the k most likely
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    grammar: str | None = None  # llguidance grammar (validated before the request was admitted)
    grammar_after_thinking: bool = False  # the grammar applies once the thinking block is closed
    think_open: bool = False  # the prompt leaves a thinking block open
    thinking_budget: int | None = None  # at most this many thinking tokens (then the block is closed)

    @property
    def needs_plain_lane(self) -> bool:
        """Logits processors the MTP round does not replay per drafted position (logprobs, penalties,
        a thinking budget): such rows decode in the plain lane. Sampling and an output grammar
        run inside the round."""
        return (self.logprobs >= 0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty not in (None, 1.0) or self.thinking_budget is not None)


class Speculate(msgspec.Struct, frozen=True):
    """How the MTP lane drafts for a row (TextMTPExecutor's plan): `block_size` tokens per round of
    the head's (the lane's block), whether the head drafts at all, and at most `context` drafts
    copied from the row's context per round (0: none), with `draft` the draft model's too (without
    `copy`: the draft model's alone), the row's proposal each round the one expected to yield more."""

    block_size: int
    head: bool = True
    context: int = 0
    draft: bool = False
    copy: bool = True


class Generate(msgspec.Struct, frozen=True):
    """Stream request: generate from a tokenized prompt. Replies: TokenDelta..., Finished.

    The plans come from the policy actors: `prefix` (PrefixCacheStore: restore, snapshot points),
    `speculate` (TextMTPExecutor: decode in the MTP lane, drafting so; None: plainly), `reuse`
    (VisionExecutor: image features to reuse), `score` (SpecPrefillScorer: score and select on
    the GPU) or `sparse` (a selection already made), `specprefill` (a report decided without
    scoring, echoed in Finished)."""

    request_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams = SamplingParams()
    vision: VisionInputs | None = None  # images / video, preprocessed off the GPU (vision path)
    prefix: PrefixPlan | None = None  # None: the prefix cache is off for this request
    speculate: Speculate | None = None
    score: ScorePlan | None = None
    sparse: SparsePrefill | None = None
    specprefill: SpecPrefillReport | None = None


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
    drafts: Drafts = Drafts()  # speculative decoding on this request: verified drafts by source
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (not prefilled)
    specprefill: SpecPrefillReport | None = None  # when SpecPrefill ran or was due for the request
    stop_sequence: str | None = None  # the request's stop string that ended it ("stop"), if one did


class AbortAll(msgspec.Struct, frozen=True):
    """Ask (the drain's deadline): end every generation with `ServerShuttingDown(reason)` and
    refuse new ones the same way. Reply: how many were ended."""

    reason: str


class Describe(msgspec.Struct, frozen=True):
    """Ask: what is loaded. Reply: ModelInfo."""


class Warmup(msgspec.Struct, frozen=True):
    """Ask: run the kernels the server will use once, so the first request does not wait.
    Reply: WarmupReport."""


class WarmupReport(msgspec.Struct, frozen=True):
    seconds: float
    # seconds of an MTP round over seconds of a plain decode step, each for a lone row, measured
    # once the kernels were compiled (None: no MTP lane)
    mtp_round_cost: float | None = None


class GetEngineStats(msgspec.Struct, frozen=True):
    """Ask: counters of the engine. Reply: EngineStats."""


class EngineStats(msgspec.Struct, frozen=True):
    running: int
    waiting: int
    scoring: int = 0  # SpecPrefill scoring jobs queued or running
    mtp_running: int = 0  # rows decoding with MTP now
    mtp_rounds: int = 0
    mtp_drafted: int = 0
    mtp_accepted: int = 0
    mtp_fallback_rounds: int = 0  # MTP rounds run eagerly while the compiled round is on (sampling rows)
    context_drafted: int = 0  # drafts copied from the rows' contexts, verified
    context_accepted: int = 0
    draft_drafted: int = 0  # a draft model's drafts, verified
    draft_accepted: int = 0
    wide_rounds: int = 0  # rounds at the host drafts' width (the context's, a draft model's)
    pipelined_rounds: int = 0  # one-token rounds run pipelined (each launched before the last was read)
    snapshots: int = 0  # prefix-cache snapshots held on the GPU thread
    snapshot_bytes: int = 0
    features: int = 0  # encoded image features held on the GPU thread
    feature_bytes: int = 0
    prefill_chunks: int = 0  # prefill forwards of our own lanes since start
    prefill_rows: int = 0  # rows those chunks carried (rows / chunks: how many were prefilled together)
    mixed_steps: int = 0  # of those chunks, the ones whose forward carried decoding rows too
    # MLX's allocator, read on the GPU thread: memory in arrays now, freed buffers it keeps cached
    # for reuse, and the most it held at once since start
    active_memory_bytes: int = 0
    cache_memory_bytes: int = 0
    peak_memory_bytes: int = 0
    # CUDA only (engine/memory/cuda_memory.py): the driver's default memory pool under MLX's allocator,
    # what it reserves from the device, hands out, and reserved at most; the device's memory in use
    cuda_pool_reserved_bytes: int | None = None
    cuda_pool_used_bytes: int | None = None
    cuda_pool_reserved_high_bytes: int | None = None
    device_used_bytes: int | None = None


class DraftInfo(msgspec.Struct, frozen=True):
    path: str
    model_type: str
    attention_layers: int  # layers whose attention the scores are read from
    load_seconds: float
    # which library runs it: mlx-vlm for a qwen3_5-family (hybrid) draft, mlx-lm otherwise
    library: Literal["mlx-lm", "mlx-vlm"] = "mlx-lm"


class EmbeddingInfo(msgspec.Struct, frozen=True):
    """The embedding model an engine holds beside its chat model (`--embedding-model`)."""

    name: str  # what requests call it (`--embedding-model-name`, default its directory's name)
    model_path: str
    model_type: str
    pooling: str  # the checkpoint's (sentence-transformers' name: "lasttoken", ...)
    dims: int
    context_length: int
    vocab_size: int


class Embed(msgspec.Struct, frozen=True):
    """GPUExecutor (stream): an embedding request's inputs (token ids, checked by the caller); the
    stream's one item is its `EmbeddedVectors`."""

    inputs: list[list[int]]


class EmbeddedVectors(msgspec.Struct, frozen=True):
    """An embedding request's vectors (its stream's event): one unit vector an input, float32
    little-endian, row-major."""

    dims: int
    vectors: bytes


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
    # the most tokens (prompt and reply) one request's caches can hold in the device's memory
    # beside the weights, the prefix cache and a prefill chunk's working set (0: not counted)
    memory_tokens: int = 0
    memory_limit_bytes: int = 0  # what that is counted within (MLX's limit, or the device's memory)
    draft: DraftInfo | None = None  # SpecPrefill's draft model, when one is loaded
    speculative_draft: str | None = None  # the draft model whose drafts the MTP lane verifies, when one is loaded
    # what the prefix cache's snapshot files must match (None: the disk tier is off)
    snapshot_identity: SnapshotIdentity | None = None
    embedding: EmbeddingInfo | None = None  # the embedding model beside the chat model, when one is loaded

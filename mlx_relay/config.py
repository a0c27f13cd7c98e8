"""Typed configuration: built once (`build_config`, from the CLI's flags or the in-process API's
keyword arguments) and passed down.

Nothing reads the environment or module globals later; each actor gets the struct it needs, whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import msgspec

#: Where a request's speculative drafts may come from: "auto" (what earns), "mtp" (the checkpoint's
#: head), "context" (copied from the prompt and the output so far), "draft" (a draft model), "none".
SpeculationMethod = Literal["auto", "mtp", "context", "draft", "none"]

class PipelineConfig(msgspec.Struct, frozen=True):
    """One model split by layers over the processes of an `mlx.launch` group (`engine/pipeline_*.py`).

    Every process runs the same engine in lockstep; rank 0 serves HTTP and tells the others each
    step's commands. `rank` is the launcher's (`MLX_RANK`), read once when the config is built and
    checked against the group at boot."""

    enabled: bool = False
    # mx.distributed.init's backend: "any" takes the first available (as mlx-lm does)
    backend: Literal["any", "ring", "mpi", "nccl", "jaccl"] = "any"
    # layers per rank (rank 0 first; rank 0 runs the LAST layers, as mlx-lm's PipelineMixin);
    # None: an even split, the low ranks taking the extra layers
    split: tuple[int, ...] | None = None
    # how a stage boundary moves the hidden state (`pipeline_stage.Stage`): send/recv, or one
    # all_sum per boundary (NCCL: MLX's CUDA backend has no send/recv); auto: collective on CUDA
    transfer: Literal["auto", "p2p", "collective"] = "auto"
    rank: int = 0
    # where rank 0 listens for the followers' liveness connections (`engine/hosting/pipeline_watch.py`):
    # its address as the launcher gave it (the ring hostfile's rank 0, NCCL_HOST_IP,
    # MLX_JACCL_COORDINATOR), read once with the rank; None: every interface, announced by host name
    leader_host: str | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError("PipelineConfig.rank must not be negative")
        if self.split is not None and any(n < 1 for n in self.split):
            raise ValueError("PipelineConfig.split must hold positive layer counts")


class EngineConfig(msgspec.Struct, frozen=True):
    """What the GPUExecutor loads and how it batches."""

    model_path: str
    max_num_seqs: int = 16
    prefill_batch_size: int = 8
    # the longest prefill chunk (tokens) a step runs, all its rows together. None: 4096 on a CUDA GPU
    # (where a chunk of 4,096 ran 1.3x faster a token than one of 2,048: its fixed costs, the experts'
    # weights read once a chunk, halve a token; benchmarks/results/prefill-h200-2026-11-28/), 2048
    # elsewhere (mlx-lm's own); on CUDA never more than one launch's routed rows allow (`engine/lane_set.py`)
    prefill_step_size: int | None = None
    # the engine step's token budget (`engine/scheduling/token_budget.py`, vLLM's max_num_batched_tokens):
    # decoding rows first (a plain row 1 token, an MTP row its verify block), then prefill chunks
    # in what is left (at least 16 tokens), shared equally by the rows prefilling (a short prompt
    # runs whole beside long ones' smaller chunks), each chunk also at most prefill_step_size.
    # A decoding row waits between two tokens on at most this many prompt tokens of others'
    # prefill; smaller: steadier decoding and shorter first tokens for short requests while long
    # prompts prefill, longer prefill for the long prompts (more steps, each with the decode
    # rows' step). None: 256 on the CPU backend (four 64-token chunks of the GatedDeltaNet prefill,
    # whose every call costs a whole chunk there: ~25-70 ms per layer on a loaded 2-core box; 128
    # prefilled two 18K prompts 1.5x slower, benchmarks/results/short-behind-long-cpu-2026-11-26/);
    # on a GPU no limit beyond prefill_step_size (the decoding rows' tokens on top), until the
    # GPU probe (benchmarks/gpu/device_short_behind_long.sh) says which budget to default to
    max_num_batched_tokens: int | None = None
    # decode priority (`engine/step/interleave.py`): while rows decode, the prefill run beside them
    # takes at most (factor - 1) times the time their decode steps take (the engine's own measured
    # costs), so a decoding stream's inter-token latency stays within about this factor of its
    # latency alone and the prompts still get (factor - 1) / factor of the time; prompts alone get
    # the whole budget every step. None: 2.5 on the CPU backend (where a step that prefills costs
    # ~30x a decode step), off on a GPU (an H200 at 2: 8 streams' ITL p90 1.56x of alone, but a 30K
    # prompt beside them 3.05x its TTFT alone; off: 24x and 1.04x); 0: off. Always off in a
    # pipeline (each rank would time its own steps, and every rank must take the same ones)
    decode_stall_factor: float | None = None
    # in a step that decodes rows and prefills a chunk, the plain lane's decode step rides in the
    # chunk's forward (`engine/models/qwen3_5/mixed.py`: one forward, each layer's weights read once
    # for both, as vLLM v1 batches decode tokens with prefill chunks); off: two forwards a step, the
    # decode step's compiled one first. On an H200 one forward saves 8-19 ms a step against two, and
    # 8 streams beside a 30K prompt had ITL p90 24.2x / long TTFT 1.04x against 26.3x / 1.13x
    # (benchmarks/results/mixed-steps-h200-2026-11-28/)
    mixed_steps: bool = True
    # how a prefill chunk's routed experts run on a CUDA GPU (`engine/models/prefill_options.py`):
    # "dequantize" for MLX's grouped GEMM, "kernel" our grouped 8-bit GEMM, "library" mlx-vlm's
    # SwitchGLU; "auto": our kernel for 8-bit experts in groups of 64 (else dequantized). Off a CUDA
    # GPU the library's always
    prefill_experts: Literal["auto", "dequantize", "kernel", "narrow", "library"] = "auto"
    # a 16-bit copy of each dense 8-bit projection beside it, for steps of 8 rows and more
    # (`engine/models/dense_copies.py`). On an H200 the copies take 1.4-3.3x less device time than
    # `kernels/dense.path`, but cuBLAS's calls cost the host more: the decode step of 8 rows took 18.3
    # against 13.4 ms, mixed steps of 16-256 tokens were slower and a lone 4K chunk 6% faster
    # (benchmarks/results/gpu-h200-2026-11-29c/); costs the copies' memory (2.9 GB on the 35B-A3B shape)
    dense_16bit: bool = False
    # the largest prefill chunk (one row or rows of one length, no padding, a multiple of 16 tokens)
    # whose recurrent mixers and MLPs run compiled per layer (`engine/models/compiled_parts.py`; the
    # mixed step of 8 rows beside a 16-token slice 44 ms against 82 eager on an H200:
    # benchmarks/results/gpu-h200-2026-11-29d/). None: 512 on a CUDA GPU, 0 (never) elsewhere
    compiled_chunk_tokens: int | None = None
    # attention keys and values kept quantized at this many bits (8 or 4; `engine/models/kv_quant.py`),
    # in the decode buffers, the prefill's caches and the prefix cache's snapshots; the recurrent
    # states stay as they are. None: as the model computes them (16-bit)
    kv_bits: int | None = None
    # an embedding model loaded beside the chat model (`engine/embeddings/`, `/v1/embeddings`): its
    # checkpoint, and the name requests give it (default: its directory's name)
    embedding_model: str | None = None
    embedding_model_name: str | None = None
    # the plain lane's decode step as one compiled function (`engine/lanes/decode_step.py`); off: the
    # same function run eagerly (for debugging: same tokens, slower)
    compile_decode: bool = True
    # the MTP lane's greedy rounds as one compiled function (`engine/lanes/mtp_step.py`, with the batched
    # verifier only); off, for sampling rows and under mtp_verify "exact": the eager round through
    # mlx-vlm's speculative cache transaction
    compile_mtp: bool = True
    # the lengths of the plain lane's prefill chunks: "fixed" runs every chunk at one of a few
    # lengths (rows right-padded) and the warm-up runs each (rows, length) once, so no prompt
    # meets a shape the device compiles kernels or library plans for (up to seconds per new
    # length on a GPU); "exact" runs chunks at the rows' own lengths (no padding: on CPU a new
    # length costs nothing extra); "auto": fixed on a GPU, exact on CPU
    prefill_shapes: Literal["auto", "fixed", "exact"] = "auto"
    warmup: bool = True
    vision_cache_bytes: int = 512 * 1024 * 1024  # encoded image features kept by content hash
    seed: int = 0  # seeds the per-request sampling seeds of requests that give none
    mtp: bool = True  # MTP speculative decoding on the text path when the checkpoint has a head
    mtp_block_size: int = 2  # tokens per verify round (1 bonus + block - 1 drafts)
    # a text request decodes with MTP only if fewer rows than this are running when it starts:
    # rounds cost 1.6x (B=1) to 2.4x (B=16) a plain step on an H200 and MTP lost at B=4 on CPU
    # (benchmarks/results/), so it pays only for (nearly) lone requests, an agent's usual case
    mtp_max_batch: int = 2
    # how a round's block is verified: "exact" is mlx-vlm's batch-invariant verifier (each row
    # and position its own matvec, bit-identical to one-token decode; fused kernels on Metal
    # only, one launch per row and position per linear elsewhere); "batched" is the model's
    # ordinary forward over the whole [B, block] (one matmul per linear, reductions may round
    # differently in low precision); "auto": exact on Metal, batched on CUDA and CPU
    mtp_verify: Literal["auto", "exact", "batched"] = "auto"
    # whether MTP is planned for a request that could take it: "auto" only where it pays on this
    # machine and model (a round's cost in plain steps, measured at warm-up, against the tokens a
    # round yields at the acceptance seen so far); "always" wherever it can run
    mtp_policy: Literal["auto", "always"] = "auto"
    # where a request's drafts come from when it does not say (`speculation.method`): "auto" is the
    # head where it pays (`mtp_policy`) and drafts copied from the request's context wherever they
    # are expected to beat it (per request and round, by what each earned: `engine/speculation/`);
    # "mtp" the head only; "context" context drafts only; "none" no speculation
    speculation: SpeculationMethod = "auto"
    # at most this many context drafts verified per round (a round then verifies 1 + this many
    # tokens); 0: no context drafts at all
    max_draft_tokens: int = 8
    # whether a row's context proposal is verified: "auto" where it is expected to yield more tokens
    # per second than the round without it (the row's acceptance so far, the widths' measured round
    # times); "always" whenever the row has one (no timing: the same rounds on every run)
    context_policy: Literal["auto", "always"] = "auto"
    # a draft model for speculative decoding (a checkpoint with the served model's vocabulary): a
    # request's `speculation.method: "draft"` takes its drafts, verified as context drafts are
    # (`engine/speculation/draft_model.py`); None: no draft model
    draft_model: str | None = None
    draft_tokens: int = 4  # a draft model's drafts per round at most
    # prefix cache: exact snapshots of prompt state at system-prompt ends and finished turns
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None  # byte budget; None: a share of the device's memory
    prefix_min_snapshot_tokens: int = 256  # shorter system prompts are not snapshotted
    # the prefix cache's disk tier: snapshots written under this directory (a directory per model)
    # survive restarts; None: memory only
    prefix_cache_dir: str | None = None
    prefix_cache_disk_bytes: int = 20 << 30  # the disk tier's byte budget (LRU over files)
    # once the server is ready, the disk tier's files (most recently used first) are loaded into
    # the memory tier up to this share of its budget; 0: none (each is loaded by its first hit)
    prefix_cache_preload: float = 0.5
    # host copies of snapshots waiting for the disk; past this, writes are dropped (counted)
    # rather than held (a slow disk never holds up decoding)
    prefix_cache_disk_queue_bytes: int = 1 << 30
    max_model_len: int | None = None  # caps the context length the checkpoint declares (None: as declared)
    memory_limit_bytes: int | None = None  # mx.set_memory_limit (None: MLX's default)
    cache_limit_bytes: int | None = None  # mx.set_cache_limit: freed buffers MLX keeps for reuse
    # when the engine drains with more than this cached, MLX's cache is cleared (the device gets a
    # burst's buffers back); None: the cache limit if given, else 5% of the device's memory
    idle_cache_bytes: int | None = None
    # where the engine (GPU thread + EngineCore) runs: "on", a process of its own (msgpack frames
    # over a pipe; no Python of the server's shares its GIL); "off", a thread of the server's;
    # "auto": on where MLX's default device is a GPU (Metal or CUDA), off on the CPU backend
    engine_process: Literal["auto", "on", "off"] = "auto"
    # one model over several processes (mlx.launch), pipelined by layers; off: this process alone
    pipeline: PipelineConfig = PipelineConfig()

    @property
    def embedding_names(self) -> tuple[str, ...]:
        """What requests may call the embedding model: its name (`embedding_model_name`, else its
        directory's) and its path as given; none without one."""
        if self.embedding_model is None:
            return ()
        name = self.embedding_model_name or self.embedding_model.rstrip("/").rsplit("/", 1)[-1]
        return (name, self.embedding_model)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("EngineConfig.max_num_batched_tokens must be at least 1")
        if self.decode_stall_factor is not None and self.decode_stall_factor != 0 and self.decode_stall_factor <= 1:
            raise ValueError("EngineConfig.decode_stall_factor must be more than 1 (or 0: off)")
        if not 0.0 <= self.prefix_cache_preload <= 1.0:
            raise ValueError("EngineConfig.prefix_cache_preload must be in [0, 1]")
        if self.embedding_model is not None and self.pipeline.enabled:
            raise ValueError("an embedding model is not served beside a pipelined model (--embedding-model with "
                             "--pipeline)")
        if not 0 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"EngineConfig.max_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}]")
        if not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"EngineConfig.draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        if self.speculation == "draft" and self.draft_model is None:
            raise ValueError('EngineConfig.speculation "draft" needs a draft model (draft_model)')
        if self.draft_model is not None and self.pipeline.enabled:
            # every rank of a pipeline must verify the same drafts: the draft would run on each
            raise ValueError("a draft model (draft_model) does not run with pipeline")
        if self.kv_bits is not None and self.kv_bits not in (4, 8):
            raise ValueError("EngineConfig.kv_bits must be 8 or 4 (or None: keys and values unquantized)")
        if self.pipeline.enabled and self.prefix_cache_dir is not None:
            # each rank holds its own layers' state: a file per snapshot would be a file per rank
            raise ValueError("the prefix cache's disk tier (prefix_cache_dir) does not run with pipeline")


#: the most context drafts a round may verify (a round's width is traced once per batch size)
MAX_DRAFT_TOKENS = 16


class SpecPrefillConfig(msgspec.Struct, frozen=True):
    """SpecPrefill: a small draft model (same tokenizer) scores the uncached part of a long
    prompt; only its most important chunks are prefilled by the target."""

    draft_model: str | None = None  # None: SpecPrefill is off
    threshold: int = 8192  # uncached prompt tokens from which it runs (unless a request says)
    chunk_size: int = 64  # prompt tokens per selection chunk
    keep_fraction: float = 0.3  # share of the scored chunks kept (the first and last always)
    query_window: int = 16  # the last prompt positions whose attention scores the tokens
    # anchors (`specprefill/anchors.py`): chunks holding a run of `anchor_ngram` tokens that the
    # query (the prompt's last `anchor_query_tokens`) repeats are kept ahead of the scores, within
    # the keep budget; 0: off (requests may set their own, `specprefill_anchor_ngram`). 2 suits
    # Qwen3.5's 248K-token vocabulary (a snake_case name is 2-3 of its tokens, and the tokens
    # around it differ between a question and the code it names); a 1K-token vocabulary such as
    # the tiny models' spells a name in more tokens: 4 there (benchmarks/specprefill_anchors.py)
    anchor_ngram: int = 2
    anchor_query_tokens: int = 64
    # a run found more often than this before the query is boilerplate (turn markers, wrappers)
    anchor_max_occurrences: int = 4
    anchor_follow: int = 16  # tokens after an occurrence that it anchors too (a key's value, a def's body)
    # the most of the keep budget (beyond the first and last chunk) anchors may take, the draft's
    # best chunks keep the rest: on relay-tiny-agent, anchors that took 85% of it at 4K tokens
    # broke replies (needle 27/40), at about half they helped (keep 0.3, 40 prompts: 36/40 at 4K
    # and 34/40 at 8K without anchors, 40/40 and 40/40 with n=2)
    anchor_max_share: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError("SpecPrefillConfig.keep_fraction must be in (0, 1]")
        if self.chunk_size < 1 or self.query_window < 1 or self.threshold < 1:
            raise ValueError("SpecPrefillConfig.chunk_size, query_window and threshold must be at least 1")
        if self.anchor_ngram < 0 or self.anchor_follow < 0 or self.anchor_max_occurrences < 1:
            raise ValueError("SpecPrefillConfig.anchor_ngram and anchor_follow must not be negative, "
                             "anchor_max_occurrences at least 1")
        if not 0.0 < self.anchor_max_share <= 1.0:
            raise ValueError("SpecPrefillConfig.anchor_max_share must be in (0, 1]")
        if self.anchor_query_tokens < max(self.anchor_ngram, 1):
            raise ValueError("SpecPrefillConfig.anchor_query_tokens must be at least anchor_ngram (and 1)")


class AdmissionConfig(msgspec.Struct, frozen=True):
    """Requests waiting for a slot (one slot per sequence: `EngineConfig.max_num_seqs`) before new
    ones are refused with 429."""

    max_queue: int = 64


class PromptConfig(msgspec.Struct, frozen=True):
    """How the Normalizer prepares prompts: in worker threads, two lanes (a large prompt never
    queues a small one), each render with a deadline; client-supplied chat templates only when
    the operator allows them, then sandboxed in a process of their own with a time limit."""

    tool_parser: str | None = None  # the model's tool-call syntax; None: inferred from the chat template
    # tool_choice "auto" with tools declared: "lazy" holds every call the model opens to a declared
    # tool and its schema (a grammar from the call's first tag on; such rows decode without MTP,
    # whose lane applies no grammar yet), "off" leaves auto calls free (MTP stays on; a malformed
    # call is delivered as written and counted)
    tool_grammar: Literal["lazy", "off"] = "lazy"
    small_workers: int = 4  # renders of prompts up to `large_prompt_bytes` at once
    large_workers: int = 1  # renders of larger prompts at once (each holds a CPU core while tokenizing)
    large_prompt_bytes: int = 256 * 1024
    render_timeout_s: float = 60.0  # one prompt's template + tokenization; past it the request is a 400
    allow_request_chat_template: bool = False  # a request's own `chat_template`
    template_timeout_s: float = 2.0  # a client template's render, in its sandbox process
    template_memory_bytes: int = 1 << 30  # the sandbox process's address-space limit

    def __post_init__(self) -> None:
        if self.small_workers < 1 or self.large_workers < 1:
            raise ValueError("PromptConfig workers must be at least 1")
        if not self.render_timeout_s > 0 or not self.template_timeout_s > 0:
            raise ValueError("PromptConfig timeouts must be positive")


class RequestLimits(msgspec.Struct, frozen=True):
    """What one HTTP request may cost before any work is done for it, and how long a client may
    take to send it or to read the answer."""

    max_request_bytes: int = 64 * 1024 * 1024  # the body; larger is a 413 before it is read whole
    max_json_depth: int = 64  # nesting of free-form JSON (schemas, tool arguments, template kwargs)
    read_timeout_s: float = 30.0  # a request's headers and body must arrive within this (408 / closed)
    stall_timeout_s: float = 60.0  # a response write the client does not take within this ends it
    # max_tokens beyond what the context leaves after the prompt: "clamp" cuts the reply at the
    # context's end (agents ask for 32K on any context), "error" answers 400 (OpenAI's and
    # Anthropic's behaviour, each in its own words)
    max_tokens_policy: Literal["error", "clamp"] = "clamp"

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024 or self.max_json_depth < 4:
            raise ValueError("RequestLimits.max_request_bytes >= 1024 and max_json_depth >= 4")
        if not self.read_timeout_s > 0 or not self.stall_timeout_s > 0:
            raise ValueError("RequestLimits timeouts must be positive")


class MediaConfig(msgspec.Struct, frozen=True):
    """What the MediaRouter may fetch and decode for image and video inputs.

    Only `data:` URLs are accepted by default: local files need `allowed_local_dir`, http(s)
    URLs need `allow_remote`, and remote hosts on loopback, private, link-local or reserved
    addresses additionally need `allow_private_networks`.
    """

    allowed_local_dir: str | None = None  # plain paths and file:// URLs only under this directory
    allow_remote: bool = False  # fetch http(s) URLs
    allow_private_networks: bool = False  # ... even from loopback/private/link-local/reserved addresses
    fetch_timeout_s: float = 10.0  # whole remote fetch, redirects included
    max_redirects: int = 3  # each hop is checked like the first
    max_media_bytes: int = 20 * 1024 * 1024  # per item, before decoding
    max_image_pixels: int = 16_777_216  # per image or video frame (4096²), checked from the header
    max_images_per_request: int = 16
    max_videos_per_request: int = 2
    max_video_frames: int = 32  # frames sampled per video (the checkpoint's own max_frames may lower it)
    video_fps: float = 2.0  # frame sampling rate

    def __post_init__(self) -> None:
        for name in ("max_media_bytes", "max_image_pixels", "max_video_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"MediaConfig.{name} must be at least 1")
        for name in ("max_images_per_request", "max_videos_per_request", "max_redirects"):
            if getattr(self, name) < 0:
                raise ValueError(f"MediaConfig.{name} must not be negative")
        if not self.video_fps > 0 or not self.fetch_timeout_s > 0:
            raise ValueError("MediaConfig.video_fps and fetch_timeout_s must be positive")


class ServerConfig(msgspec.Struct, frozen=True):
    """Everything `mlx-relay serve` needs."""

    model: str
    served_model_name: str
    engine: EngineConfig
    admission: AdmissionConfig = AdmissionConfig()
    media: MediaConfig = MediaConfig()
    specprefill: SpecPrefillConfig = SpecPrefillConfig()
    prompts: PromptConfig = PromptConfig()
    limits: RequestLimits = RequestLimits()
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # other model names requests may use for the served model ("*": any), e.g. the claude-* names
    # Claude Code sends unless told otherwise
    model_aliases: tuple[str, ...] = ()
    default_max_tokens: int = 4096
    sse_keepalive_s: float = 10.0
    drain_timeout_s: float = 30.0  # on SIGTERM: how long running requests may finish before they are ended
    # drain and exit when stdin reaches its end: the supervisor holding the pipe's other end has
    # exited, however it died (`mlx-relay cluster` starts its replicas so)
    exit_on_stdin_eof: bool = False
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"  # the process's log lines (`log_format.py`)
    # the request log's lines carry the prompt's and the reply's text (off: only counts and timings)
    log_prompts: bool = False


# nested structs whose fields `build_config` takes by name (SpecPrefillConfig's with a prefix)
_SECTIONS: dict[str, tuple[type[msgspec.Struct], str]] = {
    "engine": (EngineConfig, ""),
    "admission": (AdmissionConfig, ""),
    "media": (MediaConfig, ""),
    "specprefill": (SpecPrefillConfig, "specprefill_"),
    "prompts": (PromptConfig, ""),
    "limits": (RequestLimits, ""),
}


def build_config(model: str | Path, *, served_model_name: str | None = None, **overrides: Any) -> ServerConfig:
    """The one config builder (the CLI and `Relay.start` both use it): a ServerConfig for `model`
    with field overrides by name. A name of a nested struct's field (EngineConfig, AdmissionConfig,
    MediaConfig, PromptConfig, RequestLimits; SpecPrefillConfig's with a `specprefill_` prefix)
    sets it there; the rest are ServerConfig's own. An unknown name is a TypeError."""
    model = str(model)
    sections: dict[str, Any] = {}
    for name, (struct, prefix) in _SECTIONS.items():
        fields = set(struct.__struct_fields__) - {"model_path"}
        taken = {k.removeprefix(prefix): overrides.pop(k) for k in list(overrides)
                 if k.startswith(prefix) and k.removeprefix(prefix) in fields}
        sections[name] = struct(model_path=model, **taken) if struct is EngineConfig else struct(**taken)
    path = Path(model)
    name = served_model_name or (path.name if path.is_dir() else model)
    return ServerConfig(model=model, served_model_name=name, **sections, **overrides)

"""Typed configuration: built once from the CLI (or the in-process API) and passed down.

Nothing reads the environment or module globals later; each actor gets the struct it needs.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class EngineConfig(msgspec.Struct, frozen=True):
    """What the GPUExecutor loads and how it batches."""

    model_path: str
    max_num_seqs: int = 16
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
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
    # prefix cache: exact snapshots of prompt state at system-prompt ends and finished turns
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None  # byte budget; None: a share of the device's memory
    prefix_min_snapshot_tokens: int = 256  # shorter system prompts are not snapshotted
    memory_limit_bytes: int | None = None  # mx.set_memory_limit (None: MLX's default)
    cache_limit_bytes: int | None = None  # mx.set_cache_limit: freed buffers MLX keeps for reuse


class SpecPrefillConfig(msgspec.Struct, frozen=True):
    """SpecPrefill: a small draft model (same tokenizer) scores the uncached part of a long
    prompt; only its most important chunks are prefilled by the target."""

    draft_model: str | None = None  # None: SpecPrefill is off
    threshold: int = 8192  # uncached prompt tokens from which it runs (unless a request says)
    chunk_size: int = 64  # prompt tokens per selection chunk
    keep_fraction: float = 0.3  # share of the scored chunks kept (the first and last always)
    query_window: int = 16  # the last prompt positions whose attention scores the tokens

    def __post_init__(self) -> None:
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError("SpecPrefillConfig.keep_fraction must be in (0, 1]")
        if self.chunk_size < 1 or self.query_window < 1 or self.threshold < 1:
            raise ValueError("SpecPrefillConfig.chunk_size, query_window and threshold must be at least 1")


class AdmissionConfig(msgspec.Struct, frozen=True):
    max_num_seqs: int = 16
    max_queue: int = 64
    max_prompt_bytes: int = 32 * 1024 * 1024


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
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    # other model names requests may use for the served model ("*": any), e.g. the claude-* names
    # Claude Code sends unless told otherwise
    model_aliases: tuple[str, ...] = ()
    tool_parser: str | None = None  # the model's tool-call syntax; None: inferred from the chat template
    default_max_tokens: int = 4096
    sse_keepalive_s: float = 10.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"

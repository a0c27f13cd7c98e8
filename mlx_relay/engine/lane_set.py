"""Which lanes an engine runs, built from its config (GPU thread only; called by `EngineCore`).

A model of no family of ours (served through its library's forward, `models/library_kv.py`): the KV
lane alone. Otherwise always the plain lane, with the prefix cache on or off (a lane running mlx-
vlm's `BatchGenerator` with the cache off was retired: it took 2.3x the plain lane's time and failed
on CUDA at 4K-token prompts, `benchmarks/results/mixed-steps-h200-2026-11-28/`); the MTP lane when
the checkpoint has an MTP head and the config asks for it, or when context drafts are on
(`max_draft_tokens`; not on a pipeline stage, whose ranks must all choose alike): then a checkpoint
without a head gets the lane too, verifying context drafts only (its verifier: mlx-vlm's exact one
where asked, or on Metal with `mtp_verify="auto"`; the batched forward otherwise, and always on a
pipeline stage). The MTP lane only for a family whose checkpoints mlx-vlm loads
(`models.served_by_mtp_lane`: the lane calls mlx-vlm's model API), never for a dense Qwen3's, and
not with a quantized KV cache on a CUDA GPU (`speculation_refusal`).

Every lane's prefill chunk stays within what the backend can run in one forward
(`kernels.backend.max_chunk_tokens`: on CUDA, a mixture of experts' routed rows per launch).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mlx_relay.config import EngineConfig
from mlx_relay.engine.kernels.backend import max_chunk_tokens
from mlx_relay.engine.lane import Lane, LaneName
from mlx_relay.engine.lanes.kv_lane import KVLane
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_lane import MTPLane
from mlx_relay.engine.lanes.plain_lane import PlainLane
from mlx_relay.engine.models import UnsupportedModel, served_by_mtp_lane
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.kv_format import KVQuant
from mlx_relay.engine.models.kv_quant import head_dim
from mlx_relay.engine.models.library_kv import uses_library_forward
from mlx_relay.engine.models.loader import LoadedModel
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.speculation.draft_model import DraftModel

log = logging.getLogger(__name__)


#: the prefill step when none is configured: on a CUDA GPU a chunk of 4,096 tokens prefills 1.3x faster a
#: token than one of 2,048 (benchmarks/results/prefill-h200-2026-11-28/); elsewhere mlx-lm's 2,048
DEFAULT_STEP = {"cuda": 4096}
DEFAULT_STEP_ELSEWHERE = 2048


def prefill_step_size(lm: object, config: EngineConfig, backend: str) -> int:
    """The config's prefill step size (None: the backend's default), within the most tokens one
    forward can run on `backend`."""
    step = config.prefill_step_size or DEFAULT_STEP.get(backend, DEFAULT_STEP_ELSEWHERE)
    routed = int(getattr(getattr(lm, "args", None), "num_experts_per_tok", 0) or 0)
    limit = max_chunk_tokens(routed, backend)
    if limit is None or step <= limit:
        return step
    log.warning("prefill chunks of %d tokens instead of %d: %d routed experts a token, MLX's CUDA backend runs at "
                "most %d routed rows a launch", limit, step, routed, limit * routed)
    return limit


def quantized_kv_refusal(model_type: str, backend: str, library_forward: bool, staged: bool) -> str | None:
    """Why a quantized KV cache (`--kv-bits`) cannot serve this model here, or None. A model served
    through its library's forward has none of our quantized attention. A pipeline on a CUDA GPU is
    refused too: its plain lane prefills through the family's forward (as the unsharded server), but
    no two-rank test pins a quantized cache there on CUDA, whose `quantized_matmul` MLX 0.32.4 does not
    run at most context lengths (`models/kv_quant.py`; our own forwards dequantize there instead)."""
    if library_forward:
        return (f"a quantized KV cache (--kv-bits) needs a model family of the engine's own ({model_type} is "
                f"served through its library's forward)")
    if staged and backend == "cuda":
        return ("a quantized KV cache (--kv-bits) is not served by a pipeline on a CUDA GPU (not yet measured "
                "there; MLX's CUDA backend does not run the library's quantized attention at most lengths)")
    return None


def speculation_refusal(backend: str) -> str | None:
    """Why the MTP lane is left out with a quantized KV cache (`--kv-bits`) on `backend`, or None. Its
    sampled and grammar rows' rounds, its exact verifier and its warm-up run mlx-vlm's forward over the
    library's `QuantizedKVCache`s, whose attention is MLX's `quantized_matmul`; MLX 0.32.4's CUDA backend
    does not run it at most context lengths (an H200 at `bd632f4`: "No implementation for problem shape:
    1x1x256x16" in the lane's warm-up, `benchmarks/results/gpu-h200-2026-11-29e/`). The plain lane's own
    forwards dequantize there instead (`models/kv_quant.py`), so rows decode, unspeculated, in it."""
    if backend == "cuda":
        return ("a quantized KV cache (--kv-bits) on a CUDA GPU: speculation off, rows decode in the plain lane "
                "(the MTP lane runs the library's quantized attention, which MLX's CUDA backend does not run "
                "at most lengths)")
    return None


def build_lanes(loaded: LoadedModel, config: EngineConfig, *, token_budget: int,
                stage: Stage | None, step: int, prefill_options: PrefillOptions | None = None
                ) -> dict[LaneName, Lane]:
    """`step`: every lane's prefill chunk at most (`prefill_step_size`)."""
    info = loaded.info
    lm = loaded.model.language_model
    kv_quant = KVQuant(config.kv_bits) if config.kv_bits is not None else None
    if kv_quant is not None:
        refusal = quantized_kv_refusal(info.model_type, info.backend, uses_library_forward(lm), stage is not None)
        if refusal is not None:
            raise UnsupportedModel(refusal)
        try:
            KVQuant.group_for(head_dim(lm))
        except ValueError as exc:
            raise UnsupportedModel(f"a quantized KV cache (--kv-bits) for {info.model_type}: {exc}") from None
    if uses_library_forward(lm):
        # a model of no family of ours runs its library's forward over KV caches: one lane for all rows
        if stage is not None:
            raise UnsupportedModel(f"a pipeline split needs a model family of the engine's own "
                                   f"({info.model_type} is served through its library's forward)")
        return {"kv": KVLane(lm, prefill_step_size=min(step, token_budget),
                                eos_token_ids=info.eos_token_ids)}
    parts = CompiledParts()  # one store of compiled chunk parts: one lane's warm-up traces serve the other's
    lanes: dict[LaneName, Lane] = {
        "plain": PlainLane(lm, prefill_batch_size=config.prefill_batch_size,
                           prefill_step_size=step, eos_token_ids=info.eos_token_ids,
                           compiled=config.compile_decode,
                           fixed_prefill_shapes=config.prefill_shapes == "fixed"
                           or (config.prefill_shapes == "auto" and info.backend != "cpu"), stage=stage,
                           prefill_options=prefill_options,
                           mixed=config.mixed_steps, kv_quant=kv_quant, parts=parts)}
    # the MTP lane calls mlx-vlm's language-model API beside the family's steps: only for a family
    # whose checkpoints mlx-vlm loads (a dense Qwen3, mlx-lm's, decodes in the plain lane alone)
    speculates = served_by_mtp_lane(info.model_type)
    why_not = speculation_refusal(info.backend) if kv_quant is not None else None
    if why_not is not None and speculates and (config.mtp or config.max_draft_tokens or config.draft_model):
        log.warning("%s", why_not)
    has_head = config.mtp and info.has_mtp and speculates
    # context drafts need every rank of a pipeline to make the same choices: not in a pipeline
    context = config.max_draft_tokens if stage is None and speculates else 0
    if (has_head or context > 0 or config.draft_model is not None) and config.mtp_max_batch > 0 and why_not is None:
        # a pipeline stage verifies with the batched forward: mlx-vlm's exact verifier runs the
        # whole model in one call
        exact = stage is None and (config.mtp_verify == "exact"
                                   or (config.mtp_verify == "auto" and info.backend == "metal"))
        # no head in the checkpoint (or MTP turned off): the lane verifies context drafts only
        head = MTPHead.load(Path(info.model_path), lm, exact=exact) if has_head else MTPHead(None, lm, exact=exact)
        draft = None
        if config.draft_model is not None and stage is None:
            processor = loaded.processor
            draft = DraftModel.load(Path(config.draft_model), getattr(processor, "tokenizer", processor),
                                    config.draft_tokens, compiled=config.compile_mtp, prefill_options=prefill_options)
        lanes["mtp"] = MTPLane(lm, head, block_size=config.mtp_block_size, prefill_step_size=step,
                               eos_token_ids=info.eos_token_ids, exact_verify=exact, compiled=config.compile_mtp,
                               stage=stage, max_context=context, always_context=config.context_policy == "always",
                               prefill_options=prefill_options, draft=draft, kv_quant=kv_quant, parts=parts)
    return lanes


def speculative_draft(lanes: dict[LaneName, Lane]) -> str | None:
    """The draft model whose drafts the MTP lane verifies (its path), when one is loaded."""
    lane = lanes.get("mtp")
    return lane.draft.info.path if isinstance(lane, MTPLane) and lane.draft is not None else None

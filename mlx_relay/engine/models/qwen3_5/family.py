"""`FAMILY`: the Qwen3.5 family as the engine calls it (`models.ModelFamily`; GPU thread only)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import mlx.core as mx

from mlx_relay.engine.models import KV, Block, Chunk, ModelFamily
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5 import MODEL_TYPES, layers, mixed, mtp, pipeline, prefill


class Qwen3_5Family:
    """Hybrid GatedDeltaNet + gated attention decoders (mlx-vlm's qwen3_5 / qwen3_5_moe language models)."""

    name = "qwen3_5"
    model_types = MODEL_TYPES
    merged_groups = (("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                      "linear_attn.in_proj_a"),
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     ("mlp.gate_proj", "mlp.up_proj"),
                     ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
                     ("mlp.gate", "mlp.shared_expert_gate"))

    def layers(self, lm: Any) -> list[Any]:
        return layers.decoder_layers(lm)

    def cache_layout(self, lm: Any) -> tuple[bool, ...]:
        return tuple(bool(layer.is_linear) for layer in layers.decoder_layers(lm))

    def make_caches(self, lm: Any) -> list[Any]:
        caches: list[Any] = lm.make_cache()
        return caches

    def verify_logits(self, lm: Any, hidden: mx.array) -> mx.array:
        logits: mx.array = lm.speculative_logits_from_hidden(hidden)
        return logits

    def forward_block(self, lm: Any, tokens: mx.array, at: Positions, kv: KV, conv: list[mx.array],
                      ssm: list[mx.array], *, keep_states: bool, stage: Stage | None,
                      prefill: PrefillOptions | None = None) -> tuple[mx.array, KV, list[mx.array], list[mx.array]]:
        return layers.forward_block(lm, tokens, at, kv, conv, ssm, keep_states=keep_states, stage=stage,
                                    prefill=prefill)

    def prefill_forward(self, lm: Any, ids: mx.array, embeds: mx.array | None, caches: list[Any],
                        positions: mx.array, options: PrefillOptions,
                        after: Callable[[mx.array], None] | None = None,
                        parts: CompiledParts | None = None, normed: bool = True) -> mx.array:
        return prefill.prefill_forward(lm, ids, embeds, caches, positions, options, after, parts, normed=normed)

    def mixed_forward(self, lm: Any, chunk: Chunk, block: Block, options: PrefillOptions,
                      after: Callable[[mx.array], None] | None = None, parts: CompiledParts | None = None
                      ) -> tuple[mx.array, mx.array, KV, list[mx.array], list[mx.array]]:
        return mixed.mixed_forward(lm, chunk, block, options, after, parts)

    def logits(self, lm: Any, hidden: mx.array) -> mx.array:
        return layers.logits(lm, hidden)

    def pipeline_split(self, lm: Any, rank: int, size: int, split: tuple[int, ...] | None) -> tuple[int, int]:
        return pipeline.pipeline_split(lm, rank, size, split)

    def load_mtp_drafter(self, path: Path, config: dict[str, Any]) -> Any:
        return mtp.load_mtp_drafter(path, config)

    def check_mtp_head(self, drafter: Any) -> None:
        mtp.check_mtp_head(drafter)

    def mtp_input(self, lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array) -> mx.array:
        return mtp.mtp_input(lm, drafter, tokens, hidden)

    def mtp_head(self, lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array, head_kv: KV, at: Positions
                 ) -> tuple[mx.array, KV]:
        return mtp.mtp_head(lm, drafter, tokens, hidden, head_kv, at)


FAMILY: Final[ModelFamily] = Qwen3_5Family()  # annotated: a type checker holds it to the protocol

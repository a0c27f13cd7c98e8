"""`FAMILY`: the dense Qwen3 family as the engine calls it (`models.ModelFamily`; GPU thread only).

Its caches are mlx-vlm's `KVCache`s although mlx-lm made the layers: the engine's plain lane, its
snapshots and its decode state move rows between mlx-vlm's cache classes (`memory/batch_caches.py`,
`memory/snapshots.py`, `memory/snapshot_codec.py`, `lanes/decode_state.py`), and the family's own
prefill writes them through their public `update_and_fetch` (the two libraries' classes share that
API, not their types); mlx-lm's model never sees them. The family has no MTP head (its methods
refuse, as the protocol says) and runs in no MTP lane: that lane calls mlx-vlm's language-model API
(`models.served_by_mtp_lane`), so context drafts are not offered for it. Over a pipeline its
stages run the same prefill and decode step over their layers (`pipeline_split`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import mlx.core as mx
from mlx_vlm.models.cache import KVCache

from mlx_relay.engine.models import KV, Block, Chunk, ModelFamily, UnsupportedModel
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.pipeline_stage import Stage, stage_ranges
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3 import MODEL_TYPES, layers, mixed, prefill


def _no_head() -> UnsupportedModel:
    return UnsupportedModel("the Qwen3 family has no MTP head (model type 'qwen3' drafts nothing)")


class Qwen3Family:
    """Dense attention-only decoders (mlx-lm's qwen3 models)."""

    name = "qwen3"
    model_types = MODEL_TYPES
    merged_groups: tuple[tuple[str, ...], ...] = ()  # its layers call the library's projections one by one

    def layers(self, lm: Any) -> list[Any]:
        return layers.decoder_layers(lm)

    def cache_layout(self, lm: Any) -> tuple[bool, ...]:
        return tuple(False for _ in layers.decoder_layers(lm))

    def make_caches(self, lm: Any) -> list[Any]:
        return [KVCache() for _ in layers.decoder_layers(lm)]

    def verify_logits(self, lm: Any, hidden: mx.array) -> mx.array:
        return layers.logits(lm, hidden)  # mlx-lm's head, as its own generate takes a prompt's first token

    def forward_block(self, lm: Any, tokens: mx.array, at: Positions, kv: KV, conv: list[mx.array],
                      ssm: list[mx.array], *, keep_states: bool, stage: Stage | None,
                      prefill: PrefillOptions | None = None) -> tuple[mx.array, KV, list[mx.array], list[mx.array]]:
        return layers.forward_block(lm, tokens, at, kv, conv, ssm, keep_states=keep_states, stage=stage)

    def prefill_forward(self, lm: Any, ids: mx.array, embeds: mx.array | None, caches: list[Any],
                        positions: mx.array, options: PrefillOptions,
                        after: Callable[[mx.array], None] | None = None,
                        parts: CompiledParts | None = None, normed: bool = True) -> mx.array:
        # its chunks run eagerly
        return prefill.prefill_forward(lm, ids, embeds, caches, positions, options, after, normed=normed)

    def mixed_forward(self, lm: Any, chunk: Chunk, block: Block, options: PrefillOptions,
                      after: Callable[[mx.array], None] | None = None, parts: CompiledParts | None = None
                      ) -> tuple[mx.array, mx.array, KV, list[mx.array], list[mx.array]]:
        return mixed.mixed_forward(lm, chunk, block, options, after)

    def logits(self, lm: Any, hidden: mx.array) -> mx.array:
        return layers.logits(lm, hidden)

    def pipeline_split(self, lm: Any, rank: int, size: int, split: tuple[int, ...] | None) -> tuple[int, int]:
        # as mlx-lm's `PipelineMixin` cuts its models, through the same public attribute: the decoder's
        # `layers` become this stage's (every layer attends: any split of at least a layer a stage runs)
        cut = list(layers.decoder_layers(lm))
        start, end = stage_ranges(len(cut), size, split)[rank]
        lm.model.layers = cut[start:end]
        return start, end

    def load_mtp_drafter(self, path: Path, config: dict[str, Any]) -> Any:
        raise _no_head()

    def check_mtp_head(self, drafter: Any) -> None:
        raise _no_head()

    def mtp_input(self, lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array) -> mx.array:
        raise _no_head()

    def mtp_head(self, lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array, head_kv: KV, at: Positions
                 ) -> tuple[mx.array, KV]:
        raise _no_head()


FAMILY: Final[ModelFamily] = Qwen3Family()  # annotated: a type checker holds it to the protocol

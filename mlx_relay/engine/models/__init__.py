"""Model families: what the engine's own decode step, MTP verify round and pipeline split need to
know of a model's shape, written once per family behind one protocol (`ModelFamily`).

The steps (`decode_step.DecodeStep`, `mtp_step.MTPStep`), the prefill (`stage_forward.ModelForward`),
the MTP head (`mtp_head.MTPHead`) and the pipeline split (`pipeline_stage.shard_language_model`) hold
no family's code: they ask
`family_of(lm)` (or `family_for(model_type)`) for the family and call it. A family lives in a
package of its own under this one (`qwen3_5/`, `qwen3/`): its `__init__` names the model types it serves
(`MODEL_TYPES`, importing no MLX) and its `family` module holds the `FAMILY` object. A model type
no family serves gets `UnsupportedModel`, a load failure with a message that says why (never a
wrong token).

This module imports no MLX (the families are imported when first asked for), so the model type of
a checkpoint can be checked anywhere. ARCHITECTURE.md ("Model families") says how to add one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple, Protocol

from mlx_relay.errors import UnsupportedModel

if TYPE_CHECKING:
    from pathlib import Path

    import mlx.core as mx

    from mlx_relay.engine.models.compiled_parts import CompiledParts
    from mlx_relay.engine.models.footprint import CacheShape
    from mlx_relay.engine.models.pipeline_stage import Stage
    from mlx_relay.engine.models.positions import Positions
    from mlx_relay.engine.models.prefill_options import PrefillOptions

__all__ = [
    "FAMILY_PACKAGES",
    "Block",
    "Chunk",
    "Declared",
    "Library",
    "ModelFamily",
    "UnsupportedModel",
    "declarations",
    "declared",
    "family_for",
    "family_of",
    "served_by_family",
    "served_by_mtp_lane",
]

#: The families' packages; each has, in its `__init__` (no MLX), `MODEL_TYPES`, `LIBRARY`,
#: `MEDIA_PROCESSOR` and `cache_shape` (what `Declared` holds), and `family.FAMILY`.
FAMILY_PACKAGES: Final[tuple[str, ...]] = ("mlx_relay.engine.models.qwen3_5", "mlx_relay.engine.models.qwen3")

#: The library that loads a family's checkpoints (`engine/models/loader.py`).
Library = Literal["mlx-vlm", "mlx-lm"]


class Declared(NamedTuple):
    """What a family's package declares without MLX (its `__init__`), for the parts of the server
    that must know a family's model types before, or without, the engine: the loader, the media
    router, SpecPrefill's draft."""

    package: str
    model_types: frozenset[str]
    library: Library  # loads its checkpoints
    media_processor: str | None  # its media processor's kind (`media/served.py`), None: text only
    # a checkpoint config's cache bytes per token and per row (`footprint.CacheShape`: the pool's
    # and the engine's memory budgets)
    cache_shape: Callable[[dict[str, Any]], CacheShape]


def declarations() -> list[Declared]:
    """Every family's declaration (imports no MLX)."""
    out = []
    for package in FAMILY_PACKAGES:
        module = importlib.import_module(package)
        out.append(Declared(package, module.MODEL_TYPES, module.LIBRARY, module.MEDIA_PROCESSOR, module.cache_shape))
    return out


def declared(model_type: str) -> Declared | None:
    """The declaration of the family serving `model_type`, None when none does (imports no MLX)."""
    return next((d for d in declarations() if model_type in d.model_types), None)

KV = list[tuple["mx.array", "mx.array"]]


class Chunk(NamedTuple):
    """A prefill chunk as a family's forwards take it: token ids [B, T] (or, for vision rows, the
    prompt embeddings [B, T, H]) at M-RoPE `positions` [3, B, T], into the library's own caches."""

    ids: mx.array
    embeds: mx.array | None
    caches: list[Any]
    positions: mx.array


class Block(NamedTuple):
    """Decoding rows as a family's forwards take them: `tokens` [B, T] at `at`, over explicit
    caches (keys and values per attention layer; conv window and recurrent state per recurrent
    layer, in layer order)."""

    tokens: mx.array
    at: Positions
    kv: KV
    conv: list[mx.array]
    ssm: list[mx.array]


class ModelFamily(Protocol):
    """One family's model shape, as the engine's steps call it (GPU thread only; every method but
    `prefill_forward`, which runs eagerly, is traced into the compiled steps, so none of them may
    read a value that changes between calls)."""

    name: str
    model_types: frozenset[str]
    #: per decoder layer, the paths of projections of one input that load merged into one weight
    #: (`merged_projections.py`), and which the family's layer loop runs as one product
    merged_groups: tuple[tuple[str, ...], ...]

    def layers(self, lm: Any) -> list[Any]:
        """The language model's decoder layers; `UnsupportedModel` when `lm` is not of the family's shape."""
        ...

    def cache_layout(self, lm: Any) -> tuple[bool, ...]:
        """Per layer: True where it keeps a recurrent state (conv window + SSM state), False where
        it keeps attention keys and values (`decode_state` / `mtp_state` hold the arrays in this order)."""
        ...

    def make_caches(self, lm: Any) -> list[Any]:
        """Empty caches, one per layer, that the family's prefill keeps (`prefill_forward`,
        `mixed_forward`) and the engine moves rows in and out of (its decode state, its snapshots):
        mlx-vlm's `KVCache` and `ArraysCache`, whichever library loaded `lm`."""
        ...

    def verify_logits(self, lm: Any, hidden: mx.array) -> mx.array:
        """The logits of final hidden states as the library's speculative decoding takes them (a
        prompt's first token: on Metal batch-invariant, as the MTP lane's verify), not traced."""
        ...

    def forward_block(self, lm: Any, tokens: mx.array, at: Positions, kv: KV, conv: list[mx.array],
                      ssm: list[mx.array], *, keep_states: bool, stage: Stage | None,
                      prefill: PrefillOptions | None = None) -> tuple[mx.array, KV, list[mx.array], list[mx.array]]:
        """The final-normed hidden states [B, T, H] of `tokens` [B, T] over explicit caches, and the
        caches after: keys and values written where `at` says; per recurrent layer the conv window
        and the SSM state after the block, or (`keep_states`) the whole conv input [B, K-1+T, C] and
        the state after each position [B, T, ...] for the caller to commit from. Under a pipeline
        `stage`, this stage's layers only; every rank gets the last stage's hidden states. With
        `prefill` options, a block of many positions runs its experts as a prefill chunk's do."""
        ...

    def prefill_forward(self, lm: Any, ids: mx.array, embeds: mx.array | None, caches: list[Any],
                        positions: mx.array, options: PrefillOptions,
                        after: Callable[[mx.array], None] | None = None,
                        parts: CompiledParts | None = None, normed: bool = True) -> mx.array:
        """The final-normed hidden states [B, T, H] of a prefill chunk (token ids [B, T], or the
        prompt embeddings of vision rows) at `positions`, over the library's own caches (kept as
        the library's forward keeps them), run as `options` say (its levers, its memory bound).
        `after` sees the residual stream after each layer, in place of the family's own pacing
        (a caller that queues the layers itself, e.g. beside decode steps on another stream).
        `parts`: the caller's store of compiled parts, where a family compiles a small chunk's
        layers per part (`compiled_parts`; a family may run every chunk eagerly). `normed` False:
        the residual stream after the last layer instead, before the final norm (what a pipeline
        stage before the last sends on)."""
        ...

    def mixed_forward(self, lm: Any, chunk: Chunk, block: Block, options: PrefillOptions,
                      after: Callable[[mx.array], None] | None = None, parts: CompiledParts | None = None
                      ) -> tuple[mx.array, mx.array, KV, list[mx.array], list[mx.array]]:
        """A prefill chunk and decoding rows in one forward: the chunk's final-normed hidden states
        [B, T, H] (its caches kept as `prefill_forward` keeps them), the rows' [B', T', H] and their
        caches after (as `forward_block` without `keep_states`). Each position's arithmetic is that
        of the forward it would otherwise run in; the layers' weights are read once for both.
        `parts` as `prefill_forward`'s."""
        ...

    def logits(self, lm: Any, hidden: mx.array) -> mx.array:
        """The language model's head over hidden states."""
        ...

    def pipeline_split(self, lm: Any, rank: int, size: int, split: tuple[int, ...] | None) -> tuple[int, int]:
        """Keep only rank `rank`'s layers in `lm` (in place); the range [start, end) it keeps."""
        ...

    def load_mtp_drafter(self, path: Path, config: dict[str, Any]) -> Any:
        """The checkpoint's MTP head module (`ModelLoadError` when the family has none)."""
        ...

    def check_mtp_head(self, drafter: Any) -> None:
        """`UnsupportedModel` when the compiled round cannot run this head."""
        ...

    def mtp_input(self, lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array) -> mx.array:
        """The head's input from pairs (the next token [B, T], the target's hidden state [B, T, H])."""
        ...

    def mtp_head(self, lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array, head_kv: KV, at: Positions
                 ) -> tuple[mx.array, KV]:
        """The head's final-normed hidden states over pairs, its keys and values written where `at` says."""
        ...


def served_by_family(model_type: str) -> bool:
    """Whether a family of the engine's own serves `model_type` (imports no MLX)."""
    return declared(model_type) is not None


def served_by_mtp_lane(model_type: str) -> bool:
    """Whether the engine's MTP lane may serve rows of `model_type` (the head's drafts, or context
    drafts alone): a family of ours whose checkpoints mlx-vlm loads. Beside the family's steps, that
    lane calls mlx-vlm's language-model API (`make_cache`, a forward returning hidden states, the
    speculative cache transaction), which mlx-lm's models do not have (imports no MLX)."""
    found = declared(model_type)
    return found is not None and found.library == "mlx-vlm"


def family_for(model_type: str) -> ModelFamily:
    """The family serving `model_type` (a checkpoint's or a language model's); `UnsupportedModel`
    when none does."""
    if (found := declared(model_type)) is not None:
        family: ModelFamily = importlib.import_module(f"{found.package}.family").FAMILY
        return family
    served = sorted(t for d in declarations() for t in d.model_types)
    raise UnsupportedModel(f"model type {model_type!r} is not served by the engine's decode step "
                           f"(model families: {', '.join(served)})")


def family_of(lm: Any) -> ModelFamily:
    """The family of a loaded language model (its `model_type`, as the library names it)."""
    model_type = getattr(lm, "model_type", None) or getattr(getattr(lm, "args", None), "model_type", None)
    if not model_type:
        raise UnsupportedModel(f"{type(lm).__module__} names no model type")
    return family_for(str(model_type))

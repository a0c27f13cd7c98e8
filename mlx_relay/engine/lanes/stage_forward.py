"""The prefill's forward over batch caches: the whole model, or this process's pipeline stage
(GPU thread only).

`PrefillBatch` runs each chunk through `forward.prefill(...)` and turns the last positions of the
rows it finishes into first tokens after `forward.share(...)`; the MTP lane's row prefill calls the
forward like the language model (`__call__`):
- `ModelForward`: the model's family's prefill over the chunk (`models.ModelFamily.prefill_forward`:
  the family's layer loop over the library's caches, within `PrefillOptions`), its final (normed)
  hidden states; it keeps the compiled parts of small chunks' layers (`models/compiled_parts.py`),
  which the plain lane's mixed steps share (`decode_step.DecodeStep.beside`);
- `StageForward` (`pipeline_stage.Stage`): the same family prefill over this stage's layers only
  (the split left the model those). A stage after the first takes the previous stage's hidden
  states in place of the embeddings, a stage before the last sends on the residual stream after
  its last layer (`normed=False`). The send is tied into the stage's last cache (`mx.depends`, as
  mlx-lm's qwen3_5 pipeline does), so that evaluating the caches alone, as a chunk that finishes no
  row does, still sends. `share` gathers the last stage's rows on every rank, only the few the
  first tokens need, so every rank computes the same logits. Called like the language model
  (`__call__`), it stands in for it in the MTP lane's prefill and batched verify through the
  library's forward over the stage's layers (hidden states in as `inputs_embeds`, out through
  `capture_layer_ids`: public arguments), sharing every position's hidden state (the MTP head,
  which every rank holds, reads them all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx

from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.prefill_options import PrefillOptions


class StageOutput(NamedTuple):
    """What a `StageForward` call answers in place of the model's output: the model's final hidden
    states, on every rank (the MTP lane reads `hidden_states[-1]`)."""

    hidden_states: list[mx.array]


class ModelForward:
    def __init__(self, lm: Any, options: PrefillOptions | None = None, parts: CompiledParts | None = None) -> None:
        self.lm = lm
        self.family = family_of(lm)
        self.options = options or PrefillOptions()
        # a small chunk's layers compiled per part, kept across chunks (`models/compiled_parts.py`):
        # the engine's lanes share one store, so one lane's warm-up traces serve the other's chunks
        self.parts = parts if parts is not None else CompiledParts()

    def prefill(self, ids: mx.array, embeds: mx.array | None, caches: list[Any], positions: mx.array,
                after: Callable[[mx.array], None] | None = None) -> mx.array:
        """[B, n, D]: the final hidden states of the chunk (on this rank: see `share`); `after`: the
        family's per-layer hook (`models.ModelFamily.prefill_forward`)."""
        return self.family.prefill_forward(self.lm, ids, embeds, caches, positions, self.options, after, self.parts)

    def __call__(self, ids: mx.array, inputs_embeds: mx.array | None = None, cache: Any = None,
                 position_ids: Any = None, **_: Any) -> StageOutput:
        """As the language model's call with `return_hidden` (the MTP lane's row prefill): the
        final hidden states of every position."""
        return StageOutput([self.prefill(ids, inputs_embeds, cache, position_ids)])

    def share(self, x: mx.array) -> mx.array:
        """Rows of `prefill`'s output as the model's output on every rank."""
        return x


class StageForward(ModelForward):
    """A pipeline stage's forward: the family's prefill (`prefill`) or the library's forward
    (`__call__`) over this stage's layers, the hidden states crossing the stage boundaries."""

    def __init__(self, lm: Any, stage: Stage, options: PrefillOptions | None = None,
                 parts: CompiledParts | None = None) -> None:
        super().__init__(lm, options, parts)
        self.stage = stage

    def prefill(self, ids: mx.array, embeds: mx.array | None, caches: list[Any], positions: mx.array,
                after: Callable[[mx.array], None] | None = None) -> mx.array:
        if after is not None:  # (the engine passes none on a stage: decode priority is off there)
            raise ValueError("a pipeline stage's prefill takes no per-layer hook: work queued between its layers "
                             "(decode steps beside the chunk) would put its collectives among the stage's")
        like = self._like(ids, embeds)
        if not self.stage.first:
            embeds = self.stage.receive(like)
        out = self.family.prefill_forward(self.lm, ids, embeds, caches, positions, self.options, None, self.parts,
                                          normed=self.stage.last)
        return self._onward(out, like, caches)

    def __call__(self, ids: mx.array, inputs_embeds: mx.array | None = None, cache: Any = None,
                 **kwargs: Any) -> StageOutput:
        """As the language model's call with `return_hidden` (the MTP lane's prefill and verify):
        the whole model's final hidden states on every rank (every position: the MTP head reads
        them all)."""
        kwargs = {k: v for k, v in kwargs.items() if k not in ("return_hidden", "skip_logits")}
        return StageOutput([self.share(self.hidden(ids, inputs_embeds, cache, **kwargs))])

    def hidden(self, ids: mx.array, embeds: mx.array | None, caches: list[Any], **kwargs: Any) -> mx.array:
        """This stage's part of the library's forward; the final hidden states on the last stage,
        what was sent on elsewhere."""
        stage = self.stage
        like = self._like(ids, embeds)
        if not stage.first:
            embeds = stage.receive(like)
        last_layer = len(self.lm.model.layers) - 1
        kwargs["capture_layer_ids"] = [] if stage.last else [last_layer]
        result = self.lm(ids, inputs_embeds=embeds, cache=caches, return_hidden=True, skip_logits=True, **kwargs)
        return self._onward(result.hidden_states[-1] if stage.last else result.hidden_states[0], like, caches)

    def _like(self, ids: mx.array, embeds: mx.array | None) -> mx.array:
        """What the stage boundary carries, for its shape and dtype only (never evaluated)."""
        return embeds if embeds is not None else self.lm.model.embed_tokens(ids)

    def _onward(self, out: mx.array, like: mx.array, caches: list[Any]) -> mx.array:
        """The last stage's `out` as it is; elsewhere `out` sent to the next stage, the send tied
        into the stage's last cache, what was sent returned."""
        stage = self.stage
        stage.check(out, like.dtype)
        if stage.last:
            return out
        sent = stage.send(out)
        tail = caches[-1]
        if hasattr(tail, "keys"):  # BatchKVCache
            tail.keys = mx.depends(tail.keys, sent)
        else:  # ArraysCache: conv window and recurrent state
            tail[0] = mx.depends(tail[0], sent)
        return sent

    def share(self, x: mx.array) -> mx.array:
        return self.stage.share(x)

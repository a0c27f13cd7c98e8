"""One decode step of a language model as a pure function, compiled (GPU thread only).

    logits, state' = step(tokens, state)      # tokens [B]; logits [B, V]

The step is the language model's own layers called in order, through its family's one layer
loop (`models.ModelFamily.forward_block`; for Qwen3.5 `models/qwen3_5/layers.py`: projections,
norms, rotary embedding, GatedDeltaNet update, the MLP or mixture of experts, the head: the
library's modules and weights), with the caches made explicit (`decode_state.DecodeState`): keys
and values are written at one column with `mx.slice_update` and read under a mask, the GatedDeltaNet conv
window and recurrent state go in and out as arrays. Nothing in it reads a Python value that
changes between steps, so `mx.compile` traces it once per batch size and buffer size and
replays the trace: no graph building in Python per token, elementwise chains fused. Decode
positions are computed inside (tokens in the row's cache + its M-RoPE delta).

mlx-vlm's qwen3_5 decode does the same arithmetic through its stateful caches;
`tests/test_decode_step.py` pins that this step returns the same greedy tokens (float32), compiled
or not, alone and in ragged batches (`tests/test_qwen3_family.py` likewise for the dense Qwen3
family, `models/qwen3/layers.py`, against mlx-lm's decode).

As a pipeline stage (`pipeline_stage.Stage`) the step runs the stage's layers only: a stage after
the first receives its hidden states from the previous one, a stage before the last sends them on,
and every rank takes the last stage's output (`Stage.share`), so every rank computes the same
logits; the sends and receives are traced into the compiled function like any other op.

`beside` runs the same step inside a prefill chunk's forward (`models.ModelFamily.mixed_forward`,
eager: the chunk's shapes change from step to step; a small chunk's recurrent mixers and MLPs
compiled per layer, `models/compiled_parts.py`), the plain lane's step while a prompt
prefills: the rows' positions ride with the chunk's through every layer, one forward for both.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_relay.engine.lanes.decode_state import DecodeState
from mlx_relay.engine.models import Block, Chunk, UnsupportedModel, family_of
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.kv_quant import first
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions

__all__ = ["DecodeStep", "UnsupportedModel"]


class DecodeStep:
    """`step(tokens, state) -> logits`, updating `state`; compiled unless `compiled=False`.
    `UnsupportedModel` for a language model of no family `models` serves."""

    def __init__(self, lm: Any, *, compiled: bool = True, stage: Stage | None = None,
                 options: PrefillOptions | None = None) -> None:
        self.family = family_of(lm)
        self.lm = lm
        self.stage = stage  # a pipeline stage: only its layers, hidden states to and from its neighbours
        # the forward's kernel choices: the plain lane passes the engine's (a step with as many routed pairs
        # as the options group runs the experts grouped as a prefill chunk does, fewer `kernels.pair_qmv`);
        # None: the library's experts past `pair_qmv`'s pairs; `PrefillOptions.with_experts("library")` the
        # library's everywhere (a benchmark's other side)
        self.options = options
        self.layout = self.family.cache_layout(lm)
        self._fn = mx.compile(self._step) if compiled else self._step

    def __call__(self, tokens: mx.array, state: DecodeState) -> mx.array:
        state.ensure_room()
        logits, state.kv, state.conv, state.ssm = self._fn(
            tokens, mx.array(state.idx, dtype=mx.int32), state.left_padding, state.deltas,
            state.kv, state.conv, state.ssm)
        state.idx += 1
        return logits

    def beside(self, chunk: Chunk, tokens: mx.array, state: DecodeState, options: PrefillOptions,
               parts: CompiledParts | None = None) -> tuple[mx.array, mx.array]:
        """The step riding in a prefill chunk's forward (`models.ModelFamily.mixed_forward`, eager, or
        for a small chunk compiled per part from `parts`): the chunk's final hidden states and the
        rows' logits [B, V], updating `state` as a call does."""
        state.ensure_room()
        idx = mx.array(state.idx, dtype=mx.int32)
        block = Block(tokens[:, None], _at(idx, state.left_padding, state.deltas, state.cap), state.kv, state.conv,
                      state.ssm)
        hidden, h, state.kv, state.conv, state.ssm = self.family.mixed_forward(self.lm, chunk, block, options,
                                                                                     parts=parts)
        state.idx += 1
        return hidden, self.family.logits(self.lm, h)[:, -1, :]

    def _step(self, tokens: mx.array, idx: mx.array, left_padding: mx.array, deltas: mx.array,
              kv: list[tuple[mx.array, mx.array]], conv: list[mx.array], ssm: list[mx.array]
              ) -> tuple[mx.array, list[tuple[mx.array, mx.array]], list[mx.array], list[mx.array]]:
        at = _at(idx, left_padding, deltas, first(kv[0][0]).shape[2])
        h, kv, conv, ssm = self.family.forward_block(self.lm, tokens[:, None], at, kv, conv, ssm, keep_states=False,
                                                     stage=self.stage, prefill=self.options)
        return self.family.logits(self.lm, h)[:, -1, :], kv, conv, ssm


def _at(idx: mx.array, left_padding: mx.array, deltas: mx.array, cap: int) -> Positions:
    """Where each row's one position sits: column `idx` of buffers of `cap` columns, rotated to its
    tokens in cache (less its left padding) + its M-RoPE delta, attending to its own columns."""
    B = left_padding.shape[0]
    offsets = idx - left_padding + deltas
    positions = mx.broadcast_to(offsets[None, :, None], (3, B, 1))
    columns = mx.arange(cap)
    valid = ((columns[None, :] >= left_padding[:, None]) & (columns[None, :] <= idx))[:, None, None, :]
    return Positions.at_column(idx, positions, valid, offsets)

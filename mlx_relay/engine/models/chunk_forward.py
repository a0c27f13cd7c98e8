"""What every family's chunk forwards share beside attention (GPU thread only): how a prefill
chunk's layers are paced on a GPU (`pacing`), and how a mixed forward holds a chunk's positions
and decoding rows' positions as one sequence (`Split`: `models.ModelFamily.mixed_forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.prefill_options import PrefillOptions


def pacing(options: PrefillOptions, after: Callable[[mx.array], None] | None) -> Callable[[mx.array], None] | None:
    """The per-layer hook of a chunk's forward: the caller's `after`, else on a GPU (and
    `options.paced`) `one_layer_ahead`'s, else none (on the CPU the library's one evaluation a
    chunk: a wait a layer cost two 18K-token prompts a third more time there)."""
    if after is not None:
        return after
    if not options.paced or not cuda_kernels_available():
        return None
    in_flight: list[mx.array] = []

    def one_layer_ahead(layer_out: mx.array) -> None:
        # MLX evaluates a whole chunk's graph at once and may run each layer's independent
        # inputs (the experts it dequantizes: 1.5 GB of bfloat16 a layer of the 35B-A3B shape)
        # well before their layer: so this layer is queued, and the one before it awaited. At
        # most two layers' transients are alive, and the device never waits on the host's graph
        # building
        mx.async_eval(layer_out)
        if in_flight:
            mx.eval(in_flight.pop())
        in_flight.append(layer_out)

    return one_layer_ahead


@dataclass(frozen=True)
class Split:
    """How one sequence of positions [1, N, F] holds the chunk's [B, T, F] and the rows' [B', T', F]."""

    chunk: tuple[int, int]
    rows: tuple[int, int]

    @staticmethod
    def of(chunk: mx.array, rows: mx.array) -> Split:
        """The split of a chunk's [B, T, ...] and the rows' [B', T', ...] (their first two axes)."""
        return Split((chunk.shape[0], chunk.shape[1]), (rows.shape[0], rows.shape[1]))

    def join(self, a: mx.array, b: mx.array) -> mx.array:
        return mx.concatenate([a.reshape(1, -1, a.shape[-1]), b.reshape(1, -1, b.shape[-1])], axis=1)

    def split(self, x: mx.array) -> tuple[mx.array, mx.array]:
        n = self.chunk[0] * self.chunk[1]
        return x[:, :n].reshape(*self.chunk, -1), x[:, n:].reshape(*self.rows, -1)

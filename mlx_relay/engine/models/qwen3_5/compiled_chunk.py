"""A small prefill chunk's layers compiled per part, for the Qwen3.5 family (GPU thread only; used by
`prefill.prefill_forward` and `mixed.mixed_forward` where `compiled_route` says so).

The parts of a layer that do not read the growing context run as compiled functions
(`models/compiled_parts.py`), one per layer and chunk shape:
- a GatedDeltaNet mixer whole, from the layer's normed input to its output projection: the chunk's
  recurrence as a pure function of its conv window and state (`chunk_mixer.gated_delta_chunk`), and
  in a mixed forward the decoding rows' beside it (`kernels.gated_delta`), their projections shared;
  the library's `ArraysCache` then keeps the window and state it returns (`cache[i] = ...`, its
  public item assignment, as the library's own models write it);
- every layer's residual after its mixer: the MLP or mixture of experts (router, experts, shared
  expert, combine: `layers.run_layers`' `residual`).
Attention (the library's KV cache, the context's length) and the layer norms before the mixers run
eagerly, as does every chunk that `compiled_route` turns down. The compiled parts compute what the
eager forward computes (`tests/test_compiled_chunk.py` pins the chunk's hidden states, caches and the
rows' logits against the eager forward, float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.chunk_forward import Split
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.chunk_mixer import chunk_window, gated_delta_chunk
from mlx_relay.engine.models.qwen3_5.kernels.dense import dense
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import gated_delta_mixer
from mlx_relay.engine.models.qwen3_5.layers import Residual, gdn_projections, layer_residual


def compiled_route(parts: CompiledParts | None, options: PrefillOptions, caches: list[Any], tokens: int,
                   padded: bool) -> CompiledParts | None:
    """`parts` where a chunk of `tokens` positions runs its layers compiled per part: the options
    say so for its length (`PrefillOptions.compiles`), no row is padded, no cache records a
    speculative history; else None (the eager forward)."""
    if parts is None or padded or not options.compiles(tokens, cuda_kernels_available()):
        return None
    if any(getattr(c, "is_speculating", False) for c in caches):
        return None
    return parts


def compiled_residual(parts: CompiledParts, prefill: PrefillOptions) -> Residual:
    """`run_layers`' residual, each layer's compiled on its own."""
    def residual(layer: Any, h: mx.array, r: mx.array) -> mx.array:
        def make() -> Callable[..., Any]:
            return lambda h, r: layer_residual(layer, h, r, None, prefill)
        out: mx.array = parts.part((id(layer), "residual", prefill), make)(h, r)
        return out
    return residual


def compiled_linear(parts: CompiledParts, la: Any, x: mx.array, cache: Any, options: PrefillOptions,
                    split: Split | None = None, rows: tuple[mx.array, mx.array] | None = None
                    ) -> tuple[mx.array, list[mx.array]]:
    """The GatedDeltaNet mixer `la` of a chunk's normed input `x` ([B, T, H], or with `split` the
    chunk's and the rows' positions as one sequence and `rows` the rows' conv window and state),
    compiled: its output, and the rows' window and state after (none without rows). The chunk's
    window and state are kept in `cache`."""
    B = split.chunk[0] if split is not None else x.shape[0]
    T = split.chunk[1] if split is not None else x.shape[1]
    window = chunk_window(la, cache, B, x.dtype)
    state = cache[1]
    if state is None or state.shape[0] != B:
        state = mx.zeros((B, la.num_v_heads, la.head_v_dim, la.head_k_dim), dtype=mx.float32)

    def make() -> Callable[..., Any]:
        if split is None:
            def alone(x: mx.array, window: mx.array, state: mx.array) -> tuple[mx.array, ...]:
                out, window, state = gated_delta_chunk(la, *gdn_projections(la, x), window, state, options)
                return dense(la.out_proj, out), window, state
            return alone

        def beside(x: mx.array, window: mx.array, state: mx.array, conv: mx.array, ssm: mx.array
                   ) -> tuple[mx.array, ...]:
            ours, theirs = zip(*(split.split(p) for p in gdn_projections(la, x)), strict=True)
            out_chunk, window, state = gated_delta_chunk(la, *ours, window, state, options)
            out_rows, conv, ssm = gated_delta_mixer(la, *theirs, conv, ssm, keep_states=False)
            return dense(la.out_proj, split.join(out_chunk, out_rows)), window, state, conv, ssm
        return beside

    fn = parts.part((id(la), "linear", split, options), make)
    r, window, state, *after = fn(x, window, state, *(rows or ()))
    cache[0] = window
    cache[1] = state
    cache.advance(T)
    return r, after

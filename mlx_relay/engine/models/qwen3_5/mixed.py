"""A prefill chunk and decoding rows in one forward through the Qwen3.5 family's layer loop (GPU
thread only; `models.ModelFamily.mixed_forward`, called by the plain lane's decode step when it
rides in a prefill chunk: `lanes/decode_step.DecodeStep.beside`).

    hidden_chunk, hidden_rows, kv, conv, ssm = mixed_forward(lm, chunk, block, options)

vLLM v1 runs decode tokens and prefill chunks in one forward; so does this, for a hybrid model:
the chunk's B x T positions and the rows' B' x T' run as one sequence of positions [1, N, H]
through every part that treats positions alike (the norms, the mixers' input and output
projections, the router, the experts, the shared expert), so each layer's weights are read once
for both, and a small chunk's fixed cost (its launches, its weights) is shared with the decode
step's. Each mixer then splits its projections by kind and runs each part as its own forward
would: the chunk's recurrence and attention over the library's caches (`chunk_mixer.gated_delta_core`,
`prefill.attend_cached`), the rows' over explicit caches (`kernels.gated_delta`,
`layers.attend_explicit`), and the outputs join again before the output projection. Every
position's arithmetic is that of the forward it would otherwise run in (`tests/test_mixed_forward.py`
pins both parts against `prefill_forward` and `forward_block`, float32); the experts run as the
chunk's would (grouped on a GPU where the routed pairs are many).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.engine.models import KV, Block, Chunk
from mlx_relay.engine.models.attention import attention_mask
from mlx_relay.engine.models.chunk_forward import Split, pacing
from mlx_relay.engine.models.compiled_parts import CompiledParts
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.chunk_mixer import gated_delta_core, recurrent_mask
from mlx_relay.engine.models.qwen3_5.compiled_chunk import compiled_linear, compiled_residual, compiled_route
from mlx_relay.engine.models.qwen3_5.kernels.dense import dense
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import gated_delta_mixer
from mlx_relay.engine.models.qwen3_5.layers import (
    attend_explicit,
    gated,
    gdn_projections,
    qkv_heads,
    qkv_projections,
    rope_periods,
    run_layers,
)
from mlx_relay.engine.models.qwen3_5.prefill import attend_cached, padded, position_embeddings


def mixed_forward(lm: Any, chunk: Chunk, block: Block, options: PrefillOptions,
                  after: Callable[[mx.array], None] | None = None, parts: CompiledParts | None = None
                  ) -> tuple[mx.array, mx.array, KV, list[mx.array], list[mx.array]]:
    """`models.ModelFamily.mixed_forward`: see the module docstring (`parts`: where a small chunk's
    layers run compiled per part, `compiled_chunk`)."""
    model = lm.model
    h_chunk = chunk.embeds if chunk.embeds is not None else model.embed_tokens(chunk.ids)
    h_rows = model.embed_tokens(block.tokens)
    split = Split.of(h_chunk, h_rows)
    T = h_chunk.shape[1]
    caches = chunk.caches
    attn_mask, ssm_mask = attention_mask(caches[model.fa_idx], T), recurrent_mask(caches[model.ssm_idx], T)
    rotary = position_embeddings(model.layers, h_chunk, chunk.positions)
    periods = rope_periods(model.layers) if block.at.offsets is not None else None
    cache_of = iter(caches)  # the chunk's, one per layer in layer order
    kv_in, gdn_in = iter(block.kv), iter(zip(block.conv, block.ssm, strict=True))
    new_kv: KV = []
    new_conv: list[mx.array] = []
    new_ssm: list[mx.array] = []
    compiled = compiled_route(parts, options, caches, T, padded(attn_mask, ssm_mask))

    def linear(la: Any, x: mx.array) -> mx.array:
        if compiled is not None:
            r, (conv_state, ssm_state) = compiled_linear(compiled, la, x, next(cache_of), options, split,
                                                         next(gdn_in))
            new_conv.append(conv_state)
            new_ssm.append(ssm_state)
            return r
        ours, theirs = zip(*(split.split(p) for p in gdn_projections(la, x)), strict=True)
        out_chunk = gated_delta_core(la, *ours, next(cache_of), ssm_mask, options)
        conv_state, ssm_state = next(gdn_in)
        out_rows, conv_state, ssm_state = gated_delta_mixer(la, *theirs, conv_state, ssm_state, keep_states=False)
        new_conv.append(conv_state)
        new_ssm.append(ssm_state)
        return dense(la.out_proj, split.join(out_chunk, out_rows))

    def attend(sa: Any, x: mx.array) -> mx.array:
        ours, theirs = zip(*(split.split(p) for p in qkv_projections(sa, x)), strict=True)
        q, k, v, gate_chunk = qkv_heads(sa, *ours)
        out_chunk = gated(attend_cached(sa, q, k, v, next(cache_of), chunk.positions, rotary, attn_mask, options),
                          gate_chunk)
        q, k, v, gate_rows = qkv_heads(sa, *theirs)
        keys_buf, values_buf = next(kv_in)
        out, keys_buf, values_buf = attend_explicit(sa, q, k, v, keys_buf, values_buf, block.at, periods)
        new_kv.append((keys_buf, values_buf))
        return dense(sa.o_proj, split.join(out_chunk, gated(out, gate_rows)))

    h = run_layers(model.layers, split.join(h_chunk, h_rows), linear, attend, prefill=options,
                   after=pacing(options, after),
                   residual=None if compiled is None else compiled_residual(compiled, options))
    hidden_chunk, hidden_rows = split.split(model.norm(h))
    return hidden_chunk, hidden_rows, new_kv, new_conv, new_ssm

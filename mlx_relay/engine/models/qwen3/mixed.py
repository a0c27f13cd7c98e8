"""A prefill chunk and decoding rows in one forward through the dense Qwen3 family's layer loop (GPU
thread only; `models.ModelFamily.mixed_forward`, called by the plain lane's decode step when it
rides in a prefill chunk: `lanes/decode_step.DecodeStep.beside`).

    hidden_chunk, hidden_rows, kv, conv, ssm = mixed_forward(lm, chunk, block, options)

As Qwen3.5's (`qwen3_5/mixed.py`): the chunk's B x T positions and the rows' B' x T' run as one
sequence of positions [1, N, H] (`chunk_forward.Split`) through every part that treats positions
alike (the norms, the attention's input and output projections, the MLP), so each layer's weights
are read once for both. The attention splits its projections and runs each part as its own forward
would: the chunk's over the library's caches (`prefill.attend_cached`), the rows' over explicit
caches (`layers.attend_explicit`); the outputs join again before the output projection.
`tests/test_qwen3_family.py` pins both parts against `prefill_forward` and `forward_block`, float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlx_relay.engine.models import KV, Block, Chunk
from mlx_relay.engine.models.attention import attention_mask
from mlx_relay.engine.models.chunk_forward import Split, pacing
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3.layers import attend_explicit, merged, qkv_heads, qkv_projections, run_layers
from mlx_relay.engine.models.qwen3.prefill import attend_cached


def mixed_forward(lm: Any, chunk: Chunk, block: Block, options: PrefillOptions,
                  after: Callable[[mx.array], None] | None = None
                  ) -> tuple[mx.array, mx.array, KV, list[mx.array], list[mx.array]]:
    """`models.ModelFamily.mixed_forward`: see the module docstring (no recurrent state: the rows'
    `conv` and `ssm` come back as they came)."""
    model = lm.model
    h_chunk = chunk.embeds if chunk.embeds is not None else model.embed_tokens(chunk.ids)
    h_rows = model.embed_tokens(block.tokens)
    split = Split.of(h_chunk, h_rows)
    mask = attention_mask(chunk.caches[0], h_chunk.shape[1])
    text = chunk.positions[0]
    cache_of, kv_in = iter(chunk.caches), iter(block.kv)
    new_kv: KV = []

    def attend(sa: Any, x: mx.array) -> mx.array:
        ours, theirs = zip(*(split.split(p) for p in qkv_projections(sa, x)), strict=True)
        out_chunk = attend_cached(sa, *qkv_heads(sa, *ours), next(cache_of), text, mask, options)
        keys_buf, values_buf = next(kv_in)
        out_rows, keys_buf, values_buf = attend_explicit(sa, *qkv_heads(sa, *theirs), keys_buf, values_buf, block.at)
        new_kv.append((keys_buf, values_buf))
        return sa.o_proj(split.join(merged(out_chunk), merged(out_rows)))

    h = run_layers(model.layers, split.join(h_chunk, h_rows), attend, after=pacing(options, after))
    hidden_chunk, hidden_rows = split.split(model.norm(h))
    return hidden_chunk, hidden_rows, new_kv, list(block.conv), list(block.ssm)

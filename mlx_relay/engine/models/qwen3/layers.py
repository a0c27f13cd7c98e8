"""The dense Qwen3 family's decoder over explicit caches, written once (GPU thread only): the layer
loop of the compiled decode step (`decode_step.DecodeStep`, one position per row) and of a verify
block (T positions per row), and the head.

The layers are the library's modules and weights (mlx-lm's qwen3 model: projections, the per-head
query and key norms, the rotary embedding, the MLP, the final norm, the head); only the caches are
ours: keys and values written into fixed buffers where `Positions` says and read under its mask
(`models/attention.py`). Queries and keys are rotated by the layer's own RoPE module (mlx-lm's
`initialize_rope`: plain, linear, Llama 3, YaRN, ...), whose offset may be an array: one offset a
row (`Positions.offsets`, as mlx-lm's own batched decode rotates with its batch cache's offsets),
or, where positions are given one by one, each position as a row of its own at its offset (the
same rotation; no position need follow the one before). `tests/test_qwen3_family.py` pins the
logits and the greedy tokens against mlx-lm's own forward, float32.

The loop itself (`run_layers`: each layer's attention, then its MLP, on the residual stream) serves
three ways of keeping caches: `forward_block` (the steps' explicit arrays), `prefill.prefill_forward`
(a prefill chunk over the library's own caches) and `mixed.mixed_forward` (both in one forward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from mlx_relay.engine.models import KV, UnsupportedModel
from mlx_relay.engine.models.attention import attend_buffers
from mlx_relay.engine.models.positions import Positions

if TYPE_CHECKING:
    from mlx_relay.engine.models.pipeline_stage import Stage

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rope", "n_heads", "n_kv_heads", "scale")


def decoder_layers(lm: Any) -> list[Any]:
    """The decoder's layers; `UnsupportedModel` unless each is mlx-lm's Qwen3 block (attention with
    per-head query and key norms and a RoPE module, an MLP)."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not layers or not all(all(hasattr(getattr(layer, "self_attn", None), a) for a in _ATTENTION)
                             and hasattr(layer, "mlp") for layer in layers):
        raise UnsupportedModel(f"{type(lm).__module__} is not a dense Qwen3 language model")
    return list(layers)


def qkv_projections(sa: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The attention's input projections of `x` [B, T, H]: (queries, keys, values)."""
    return sa.q_proj(x), sa.k_proj(x), sa.v_proj(x)


def qkv_heads(sa: Any, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The library's attention from its projections [B, T, *] up to the rotary embedding: queries,
    keys and values [B, T, heads, D], the queries and keys normed."""
    B, T, _ = q.shape
    queries = sa.q_norm(q.reshape(B, T, sa.n_heads, -1))
    keys = sa.k_norm(k.reshape(B, T, sa.n_kv_heads, -1))
    return queries, keys, v.reshape(B, T, sa.n_kv_heads, -1)


def rotate_rows(sa: Any, x: mx.array, offsets: mx.array) -> mx.array:
    """`x` [B, T, heads, D] rotated to row i's positions offsets[i] + t: [B, heads, T, D]."""
    out: mx.array = sa.rope(x.transpose(0, 2, 1, 3), offset=offsets)
    return out


def rotate_positions(sa: Any, x: mx.array, positions: mx.array) -> mx.array:
    """`x` [B, T, heads, D] rotated to `positions` [B, T], each position on its own: [B, heads, T, D]."""
    B, T, heads, D = x.shape
    out = sa.rope(x.reshape(B * T, heads, 1, D), offset=positions.reshape(-1).astype(mx.int32))
    return out.reshape(B, T, heads, D).transpose(0, 2, 1, 3)


def merged(out: mx.array) -> mx.array:
    """The attention's output [B, heads, T, D] as its output projection takes it: [B, T, heads * D]."""
    B, _, T, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, T, -1)


def attend_explicit(sa: Any, queries: mx.array, keys: mx.array, values: mx.array, keys_buf: mx.array,
                    values_buf: mx.array, at: Positions) -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys and values [B, T, heads, D] rotated to where `at` says (its per-row offsets, else
    its rotary positions' first section, the text positions), the keys and values written there:
    the attention's output [B, heads, T, D] and the buffers after."""
    if at.offsets is not None:
        queries, keys = rotate_rows(sa, queries, at.offsets), rotate_rows(sa, keys, at.offsets)
    else:
        positions = at.rotary[0]
        queries, keys = rotate_positions(sa, queries, positions), rotate_positions(sa, keys, positions)
    return attend_buffers(queries, keys, values.transpose(0, 2, 1, 3), keys_buf, values_buf, at, sa.scale)


def attention(sa: Any, x: mx.array, keys_buf: mx.array, values_buf: mx.array, at: Positions
              ) -> tuple[mx.array, mx.array, mx.array]:
    """The attention of T queries per row; their keys and values written where `at` says."""
    out, keys_buf, values_buf = attend_explicit(sa, *qkv_heads(sa, *qkv_projections(sa, x)), keys_buf, values_buf, at)
    return sa.o_proj(merged(out)), keys_buf, values_buf


#: The attention as the loop calls it: (the library's attention module, the layer's normed input) -> its output.
Attend = Callable[[Any, mx.array], mx.array]


def run_layers(layers: list[Any], h: mx.array, attend: Attend, *, after: Callable[[mx.array], None] | None = None
               ) -> mx.array:
    """The one layer loop: the residual stream after `layers`, each its attention (`attend`, which
    keeps the caches: called in layer order), then its MLP, as the library's block adds them;
    `after` sees the residual stream after each layer (an eager caller's hook)."""
    for layer in layers:
        h = h + attend(layer.self_attn, layer.input_layernorm(h))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if after is not None:
            after(h)
    return h


def forward_block(lm: Any, tokens: mx.array, at: Positions, kv: KV, conv: list[mx.array], ssm: list[mx.array],
                  *, keep_states: bool, stage: Stage | None) -> tuple[mx.array, KV, list[mx.array], list[mx.array]]:
    """`models.ModelFamily.forward_block`: the layer loop over explicit caches (no recurrent layer:
    `conv`, `ssm` and `keep_states` have nothing to hold); under a pipeline `stage` its layers only."""
    if conv or ssm:
        raise ValueError("a Qwen3 model keeps no recurrent state")
    new_kv: KV = []
    kv_in = iter(kv)

    def attend(sa: Any, x: mx.array) -> mx.array:
        keys_buf, values_buf = next(kv_in)
        r, keys_buf, values_buf = attention(sa, x, keys_buf, values_buf, at)
        new_kv.append((keys_buf, values_buf))
        return r

    h = lm.model.embed_tokens(tokens)
    wire = h.dtype  # what a stage boundary carries (the embeddings')
    if stage is not None:
        h = stage.enter(h)
    h = run_layers(lm.model.layers, h, attend)
    if stage is not None:  # every rank: the last stage's hidden states
        h = stage.leave(h, wire)
    return lm.model.norm(h), new_kv, [], []


def logits(lm: Any, hidden: mx.array) -> mx.array:
    """The head: the tied embeddings where the checkpoint ties them, else `lm_head`."""
    out: mx.array = lm.model.embed_tokens.as_linear(hidden) if lm.args.tie_word_embeddings else lm.lm_head(hidden)
    return out

"""The Qwen3.5 family's decoder over explicit caches, written once (GPU thread only): the layer loop
of the compiled decode step (`decode_step.DecodeStep`, one position per row) and of the MTP verify
round (`mtp_step.MTPStep`, a block of k positions per row).

The layers are the library's modules and weights (mlx-vlm's qwen3_5 language model: projections,
norms, rotary embedding, the MLP or mixture of experts, the head); only the caches are ours: keys
and values written into fixed buffers where `Positions` says and read under its mask, the
GatedDeltaNet conv window and recurrent state in and out as arrays. The arithmetic is the
library's own decode (`tests/test_decode_step.py` and `tests/test_mtp_step.py` pin the greedy
tokens, float32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_update, gated_delta_update_with_states

from mlx_relay.engine.models import KV, UnsupportedModel
from mlx_relay.engine.models.positions import Positions

if TYPE_CHECKING:
    from mlx_relay.engine.models.pipeline_stage import Stage


def decoder_layers(lm: Any) -> list[Any]:
    """The decoder's layers; `UnsupportedModel` unless each is a GatedDeltaNet or an attention layer."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not layers or not all(hasattr(layer, "linear_attn" if getattr(layer, "is_linear", None) else "self_attn")
                             for layer in layers):
        raise UnsupportedModel(f"{type(lm).__module__} is not a Qwen3.5-family language model")
    return list(layers)


def normalize_qk(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    # as the library's GatedDeltaNet: L2 normalisation as an RMS norm with epsilon over the width
    inv_scale = k.shape[-1] ** -0.5
    eps = 1e-6 / k.shape[-1]
    return (inv_scale**2) * mx.fast.rms_norm(q, None, eps), inv_scale * mx.fast.rms_norm(k, None, eps)


def _conv(la: Any, conv_in: mx.array, T: int) -> mx.array:
    """The causal depthwise conv's T outputs over [B, K-1+T, C]; low precision weights accumulate
    in float32 per position, as the library's one-token decode does."""
    weight = la.conv1d.weight  # [C, K, 1]
    if weight.dtype not in (mx.bfloat16, mx.float16):
        return la.conv1d(conv_in)
    K = weight.shape[1]
    w = weight[:, :, 0].T.astype(mx.float32)
    if T == 1:  # the input is the one window
        return mx.sum(conv_in.astype(mx.float32) * w[None], axis=1).astype(conv_in.dtype)[:, None, :]
    outs = [mx.sum(conv_in[:, j:j + K, :].astype(mx.float32) * w[None], axis=1) for j in range(T)]
    return mx.stack(outs, axis=1).astype(conv_in.dtype)


def gated_delta_net(la: Any, x: mx.array, conv_state: mx.array, ssm: mx.array, *, keep_states: bool
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Output [B, T, H] and, per `models.ModelFamily.forward_block`: the conv window and recurrent
    state after the block, or (`keep_states`) the conv input [B, K-1+T, C] and the state after
    each position [B, T, Hv, Dv, Dk]."""
    B, T, _ = x.shape
    mixed = la.in_proj_qkv(x)
    z = la.in_proj_z(x).reshape(B, T, -1, la.head_v_dim)
    b, a = la.in_proj_b(x), la.in_proj_a(x)
    conv_in = mx.concatenate([conv_state, mixed], axis=1)
    conv = nn.silu(_conv(la, conv_in, T))
    q, k, v = (t.reshape(B, T, h, d) for t, h, d in zip(
        mx.split(conv, [la.key_dim, 2 * la.key_dim], -1),
        (la.num_k_heads, la.num_k_heads, la.num_v_heads),
        (la.head_k_dim, la.head_k_dim, la.head_v_dim), strict=True))
    q, k = normalize_qk(q, k)
    if keep_states:
        out, _final, ssm = gated_delta_update_with_states(q, k, v, a, b, la.A_log, la.dt_bias, state=ssm,
                                                          state_steps=T)
    else:
        out, ssm = gated_delta_update(q, k, v, a, b, la.A_log, la.dt_bias, state=ssm)
        conv_in = conv_in[:, T:, :]  # the window after the block
    out = la.norm(out, z)
    return la.out_proj(out.reshape(B, T, -1)), conv_in, ssm


def attention(sa: Any, x: mx.array, keys_buf: mx.array, values_buf: mx.array, at: Positions
              ) -> tuple[mx.array, mx.array, mx.array]:
    """Gated attention of T queries per row; their keys and values written where `at` says."""
    B, T, _ = x.shape
    queries, gate = mx.split(sa.q_proj(x).reshape(B, T, sa.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, T, -1)
    queries = sa.q_norm(queries).transpose(0, 2, 1, 3)
    keys = sa.k_norm(sa.k_proj(x).reshape(B, T, sa.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = sa.v_proj(x).reshape(B, T, sa.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = sa.rotary_emb.apply_rotary(queries, keys, at.rotary, unsqueeze_dim=1)
    keys_buf = at.write(keys_buf, keys)
    values_buf = at.write(values_buf, values)
    out = mx.fast.scaled_dot_product_attention(queries, keys_buf, values_buf, scale=sa.scale, mask=at.mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
    return sa.o_proj(out * mx.sigmoid(gate)), keys_buf, values_buf


def _residual(layer: Any, h: mx.array, r: mx.array) -> mx.array:
    """The residual stream after a layer whose mixer returned `r`: the mixer's output, then the MLP's."""
    h = h + r
    return h + layer.mlp(layer.post_attention_layernorm(h))


def attention_layer(layer: Any, h: mx.array, keys_buf: mx.array, values_buf: mx.array, at: Positions
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """One full-attention decoder layer (the target's, or the MTP head's): the residual stream after it."""
    r, keys_buf, values_buf = attention(layer.self_attn, layer.input_layernorm(h), keys_buf, values_buf, at)
    return _residual(layer, h, r), keys_buf, values_buf


def forward_block(lm: Any, tokens: mx.array, at: Positions, kv: KV, conv: list[mx.array], ssm: list[mx.array],
                  *, keep_states: bool, stage: Stage | None) -> tuple[mx.array, KV, list[mx.array], list[mx.array]]:
    """`models.ModelFamily.forward_block`: the one layer loop."""
    h = lm.model.embed_tokens(tokens)
    if stage is not None and not stage.first:
        h = stage.receive(h)
    new_kv, new_conv, new_ssm = [], [], []
    kv_in, gdn_in = iter(kv), iter(zip(conv, ssm, strict=True))
    for layer in lm.model.layers:
        if layer.is_linear:
            conv_state, ssm_state = next(gdn_in)
            r, conv_state, ssm_state = gated_delta_net(layer.linear_attn, layer.input_layernorm(h), conv_state,
                                                       ssm_state, keep_states=keep_states)
            new_conv.append(conv_state)
            new_ssm.append(ssm_state)
            h = _residual(layer, h, r)
        else:
            keys_buf, values_buf = next(kv_in)
            h, keys_buf, values_buf = attention_layer(layer, h, keys_buf, values_buf, at)
            new_kv.append((keys_buf, values_buf))
    if stage is not None:  # every rank: the last stage's hidden states, every position
        h = stage.share(h if stage.last else stage.send(h))
    return lm.model.norm(h), new_kv, new_conv, new_ssm


def logits(lm: Any, hidden: mx.array) -> mx.array:
    return lm.model.embed_tokens.as_linear(hidden) if lm.args.tie_word_embeddings else lm.lm_head(hidden)

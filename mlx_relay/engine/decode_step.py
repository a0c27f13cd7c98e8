"""One decode step of a Qwen3.5-family language model as a pure function, compiled (GPU thread only).

    logits, state' = step(tokens, state)      # tokens [B]; logits [B, V]

The step is the language model's own layers called in order (projections, norms, rotary
embedding, GatedDeltaNet update, the MLP or mixture of experts, the head: the library's modules
and weights), with the caches made explicit (`decode_state.DecodeState`): keys and values are
written at one column with `mx.slice_update` and read under a mask, the GatedDeltaNet conv
window and recurrent state go in and out as arrays. Nothing in it reads a Python value that
changes between steps, so `mx.compile` traces it once per batch size and buffer size and
replays the trace: no graph building in Python per token, elementwise chains fused. Decode
positions are computed inside (tokens in the row's cache + its M-RoPE delta).

mlx-vlm's qwen3_5 decode does the same arithmetic through its stateful caches;
`tests/test_decode_step.py` pins that this step returns the same greedy tokens (float32), compiled
or not, alone and in ragged batches.

As a pipeline stage (`pipeline_stage.Stage`) the step runs the stage's layers only: a stage after
the first receives its hidden states from the previous one, a stage before the last sends them on,
and every rank takes the last stage's output (`Stage.share`), so every rank computes the same
logits; the sends and receives are traced into the compiled function like any other op.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_update

from mlx_relay.engine.decode_state import DecodeState
from mlx_relay.engine.pipeline_stage import Stage


class UnsupportedModel(Exception):
    """The language model is not of the Qwen3.5 family's shape."""


def _normalize_qk(q: mx.array, k: mx.array) -> tuple[mx.array, mx.array]:
    # as the library's GatedDeltaNet: L2 normalisation as an RMS norm with epsilon over the width
    inv_scale = k.shape[-1] ** -0.5
    eps = 1e-6 / k.shape[-1]
    return (inv_scale**2) * mx.fast.rms_norm(q, None, eps), inv_scale * mx.fast.rms_norm(k, None, eps)


def _conv(la: Any, window: mx.array) -> mx.array:
    """The causal depthwise conv over a decode window [B, K, C] (one output position); low
    precision weights accumulate in float32, as the library's decode does."""
    weight = la.conv1d.weight  # [C, K, 1]
    if weight.dtype in (mx.bfloat16, mx.float16):
        w = weight[:, :, 0].T.astype(mx.float32)
        return mx.sum(window.astype(mx.float32) * w[None], axis=1).astype(window.dtype)[:, None, :]
    return la.conv1d(window)


def _gated_delta_net(la: Any, x: mx.array, conv_state: mx.array, ssm: mx.array
                     ) -> tuple[mx.array, mx.array, mx.array]:
    B = x.shape[0]
    mixed = la.in_proj_qkv(x)
    z = la.in_proj_z(x).reshape(B, 1, -1, la.head_v_dim)
    b, a = la.in_proj_b(x), la.in_proj_a(x)
    window = mx.concatenate([conv_state, mixed], axis=1)
    conv = nn.silu(_conv(la, window))
    q, k, v = (t.reshape(B, 1, h, d) for t, h, d in zip(
        mx.split(conv, [la.key_dim, 2 * la.key_dim], -1),
        (la.num_k_heads, la.num_k_heads, la.num_v_heads),
        (la.head_k_dim, la.head_k_dim, la.head_v_dim), strict=True))
    q, k = _normalize_qk(q, k)
    out, ssm = gated_delta_update(q, k, v, a, b, la.A_log, la.dt_bias, state=ssm)
    out = la.norm(out, z)
    return la.out_proj(out.reshape(B, 1, -1)), window[:, 1:, :], ssm


def _attention(sa: Any, x: mx.array, keys_buf: mx.array, values_buf: mx.array, idx: mx.array,
               valid: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    B = x.shape[0]
    queries, gate = mx.split(sa.q_proj(x).reshape(B, 1, sa.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, 1, -1)
    queries = sa.q_norm(queries).transpose(0, 2, 1, 3)
    keys = sa.k_norm(sa.k_proj(x).reshape(B, 1, sa.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = sa.v_proj(x).reshape(B, 1, sa.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = sa.rotary_emb.apply_rotary(queries, keys, positions, unsqueeze_dim=1)
    keys_buf = mx.slice_update(keys_buf, keys.astype(keys_buf.dtype), idx, axes=(2,))
    values_buf = mx.slice_update(values_buf, values.astype(values_buf.dtype), idx, axes=(2,))
    out = mx.fast.scaled_dot_product_attention(queries, keys_buf, values_buf, scale=sa.scale, mask=valid)
    out = out.transpose(0, 2, 1, 3).reshape(B, 1, -1)
    return sa.o_proj(out * mx.sigmoid(gate)), keys_buf, values_buf


class DecodeStep:
    """`step(tokens, state) -> logits`, updating `state`; compiled unless `compiled=False`."""

    def __init__(self, lm: Any, *, compiled: bool = True, stage: Stage | None = None) -> None:
        layers = getattr(getattr(lm, "model", None), "layers", None)
        if not layers or not all(hasattr(layer, "linear_attn" if getattr(layer, "is_linear", None) else "self_attn")
                                 for layer in layers):
            raise UnsupportedModel(f"{type(lm).__module__} is not a Qwen3.5-family language model")
        self.lm = lm
        self.stage = stage  # a pipeline stage: only its layers, hidden states to and from its neighbours
        self.layout = tuple(bool(layer.is_linear) for layer in layers)
        self._fn = mx.compile(self._step) if compiled else self._step

    def __call__(self, tokens: mx.array, state: DecodeState) -> mx.array:
        state.ensure_room()
        logits, state.kv, state.conv, state.ssm = self._fn(
            tokens, mx.array(state.idx, dtype=mx.int32), state.left_padding, state.deltas,
            state.kv, state.conv, state.ssm)
        state.idx += 1
        return logits

    def _step(self, tokens: mx.array, idx: mx.array, left_padding: mx.array, deltas: mx.array,
              kv: list[tuple[mx.array, mx.array]], conv: list[mx.array], ssm: list[mx.array]
              ) -> tuple[mx.array, list[tuple[mx.array, mx.array]], list[mx.array], list[mx.array]]:
        lm = self.lm
        B = tokens.shape[0]
        positions = mx.broadcast_to((idx - left_padding + deltas)[None, :, None], (3, B, 1))
        columns = mx.arange(kv[0][0].shape[2])
        valid = ((columns[None, :] >= left_padding[:, None]) & (columns[None, :] <= idx))[:, None, None, :]
        h = lm.model.embed_tokens(tokens[:, None])
        stage = self.stage
        if stage is not None and not stage.first:
            h = stage.receive(h)
        new_kv, new_conv, new_ssm = [], [], []
        kv_in, gdn_in = iter(kv), iter(zip(conv, ssm, strict=True))
        for layer in lm.model.layers:
            x = layer.input_layernorm(h)
            if layer.is_linear:
                conv_state, ssm_state = next(gdn_in)
                r, conv_state, ssm_state = _gated_delta_net(layer.linear_attn, x, conv_state, ssm_state)
                new_conv.append(conv_state)
                new_ssm.append(ssm_state)
            else:
                keys_buf, values_buf = next(kv_in)
                r, keys_buf, values_buf = _attention(layer.self_attn, x, keys_buf, values_buf, idx, valid, positions)
                new_kv.append((keys_buf, values_buf))
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if stage is not None:
            h = stage.share(h if stage.last else stage.send(h))
        h = lm.model.norm(h)
        logits = lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)
        return logits[:, -1, :], new_kv, new_conv, new_ssm

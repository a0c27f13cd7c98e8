"""The Qwen3.5 family's decoder over explicit caches, written once (GPU thread only): the layer loop
of the compiled decode step (`decode_step.DecodeStep`, one position per row) and of the MTP verify
round (`mtp_step.MTPStep`, a block of k positions per row).

The layers are the library's modules and weights (mlx-vlm's qwen3_5 language model: projections,
norms, rotary embedding, the MLP or mixture of experts, the head); only the caches are ours: keys
and values written into fixed buffers where `Positions` says and read under its mask, the
GatedDeltaNet conv window and recurrent state in and out as arrays. The arithmetic is the
library's own decode (`tests/test_decode_step.py`, `tests/test_mtp_step.py` and
`tests/test_moe_decode.py` pin the greedy tokens, float32). Where the library runs a chain of small
operations the loop calls one launch instead (issue 32: the step is launch-bound on a GPU): a
GatedDeltaNet layer between its projections and a mixture of experts' router and combine through
`kernels/` (this family's CUDA kernels, the library's ops elsewhere), text positions rotated with MLX's
fused rope, the expert matmuls' row indices made once per step (`ExpertRows`), and each dense 8-bit
projection through `kernels.dense` (on a CUDA GPU ours over 8 to 32 rows, dequantized for a 16-bit
matmul over many rows or a narrow output; the library's call otherwise).

The loop itself (`run_layers`: each layer's mixer, then its MLP or mixture of experts, on the
residual stream) is written once and serves two ways of keeping caches: `forward_block` (the
steps' explicit arrays) and `prefill.prefill_forward` (a prefill chunk over the library's own
caches). A chunk's many routed positions run the experts as grouped GEMMs (`kernels.grouped_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx

from mlx_relay.engine.models import KV, UnsupportedModel
from mlx_relay.engine.models.attention import attend_buffers
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5.kernels.dense import dense, dense_many
from mlx_relay.engine.models.qwen3_5.kernels.dense import mlp as dense_mlp
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import gated_delta_mixer
from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import grouped_switch_glu, use_grouped
from mlx_relay.engine.models.qwen3_5.kernels.moe import combine, route_topk
from mlx_relay.engine.models.qwen3_5.kernels.pair_qmv import pair_switch_glu, use_pairs

if TYPE_CHECKING:
    from mlx_relay.engine.models.pipeline_stage import Stage


def decoder_layers(lm: Any) -> list[Any]:
    """The decoder's layers; `UnsupportedModel` unless each is a GatedDeltaNet or an attention layer."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not layers or not all(hasattr(layer, "linear_attn" if getattr(layer, "is_linear", None) else "self_attn")
                             for layer in layers):
        raise UnsupportedModel(f"{type(lm).__module__} is not a Qwen3.5-family language model")
    return list(layers)


def gdn_projections(la: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A GatedDeltaNet mixer's input projections of `x`: (qkv, z, b, a), as the library's."""
    qkv, z, b, a = dense_many((la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a), x, views=True)
    return qkv, z, b, a


def gated_delta_net(la: Any, x: mx.array, conv_state: mx.array, ssm: mx.array, *, keep_states: bool
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Output [B, T, H] and, per `models.ModelFamily.forward_block`: the conv window and recurrent
    state after the block, or (`keep_states`) the conv input [B, K-1+T, C] and the state after
    each position [B, T, Hv, Dv, Dk]. Between the projections: `kernels.gated_delta`."""
    out, conv_state, ssm = gated_delta_mixer(la, *gdn_projections(la, x), conv_state, ssm, keep_states=keep_states)
    return dense(la.out_proj, out), conv_state, ssm


def rope_periods(layers: list[Any]) -> mx.array | None:
    """The periods (1 / the library's inverse frequencies) that make `mx.fast.rope` rotate text
    positions exactly as the first attention layer of `layers` does with the library's M-RoPE
    (every section at one position; the float32 tests pin it), or None where the rotary embedding
    is not of that kind."""
    sa = next((getattr(layer, "self_attn", None) for layer in layers if not getattr(layer, "is_linear", False)), None)
    rotary = getattr(sa, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or not isinstance(getattr(rotary, "dim", None), int) \
            or getattr(rotary, "attention_scaling", 1.0) != 1.0:
        return None
    return 1.0 / inv_freq


def _rotate(sa: Any, queries: mx.array, keys: mx.array, at: Positions, periods: mx.array | None
            ) -> tuple[mx.array, mx.array]:
    """Queries and keys [B, heads, T, D] rotated to their positions: MLX's fused rope (one kernel
    each) where `at` holds text positions, the library's M-RoPE otherwise."""
    if at.offsets is None or periods is None:
        return sa.rotary_emb.apply_rotary(queries, keys, at.rotary, unsqueeze_dim=1)
    dims = sa.rotary_emb.dim
    return tuple(mx.fast.rope(t, dims, traditional=False, base=None, scale=1.0, offset=at.offsets, freqs=periods)
                 for t in (queries, keys))  # type: ignore[return-value]


def qkv_projections(sa: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The gated attention's input projections of `x` [B, T, H]: (queries with their gate, keys, values)."""
    q, k, v = dense_many((sa.q_proj, sa.k_proj, sa.v_proj), x)
    return q, k, v


def qkv_heads(sa: Any, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The library's gated attention from its projections [B, T, *] up to the rotary embedding:
    queries, keys and values [B, heads, T, D] (queries and keys normed) and the output gate [B, T, heads * D]."""
    B, T, _ = q.shape
    queries, gate = mx.split(q.reshape(B, T, sa.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, T, -1)
    queries = sa.q_norm(queries).transpose(0, 2, 1, 3)
    keys = sa.k_norm(k.reshape(B, T, sa.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = v.reshape(B, T, sa.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    return queries, keys, values, gate


def project_qkv(sa: Any, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """`qkv_heads` of `x`'s projections."""
    return qkv_heads(sa, *qkv_projections(sa, x))


def gated(out: mx.array, gate: mx.array) -> mx.array:
    """The attention's output [B, heads, T, D] gated, before its output projection: [B, T, heads * D]."""
    B, _, T, _ = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, T, -1) * mx.sigmoid(gate)


def gated_output(sa: Any, out: mx.array, gate: mx.array) -> mx.array:
    """The attention's output [B, heads, T, D] gated and projected: the mixer's output [B, T, H]."""
    return dense(sa.o_proj, gated(out, gate))


def attend_explicit(sa: Any, queries: mx.array, keys: mx.array, values: mx.array, keys_buf: mx.array,
                    values_buf: mx.array, at: Positions, periods: mx.array | None = None
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys and values [B, heads, T, D] rotated to where `at` says, the keys and values
    written there: the attention's output [B, heads, T, D] and the buffers after."""
    queries, keys = _rotate(sa, queries, keys, at, periods)
    return attend_buffers(queries, keys, values, keys_buf, values_buf, at, sa.scale)


def attention(sa: Any, x: mx.array, keys_buf: mx.array, values_buf: mx.array, at: Positions,
              periods: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    """Gated attention of T queries per row; their keys and values written where `at` says."""
    queries, keys, values, gate = project_qkv(sa, x)
    out, keys_buf, values_buf = attend_explicit(sa, queries, keys, values, keys_buf, values_buf, at, periods)
    return gated_output(sa, out, gate), keys_buf, values_buf


class ExpertRows(NamedTuple):
    """For a forward's few rows (the decode step's one position per row, the MTP verify's block):
    which input row each expert matmul reads, made once per forward and shared by every layer
    (left to itself, `mx.gather_qmm` makes these with an `arange` per call: three launches per
    layer). Both are whole [B, T, k] arrays: MLX's CUDA `GatherQMM` copies indices that are not
    row-contiguous, so [B, T, 1] broadcast against the experts' [B, T, k] cost a copy a call (two
    launches a layer: 80 of the 1-row step's 1,084 on the 35B-A3B shape, H200 profile at `7fe2ab8`)."""

    inputs: mx.array  # [B, T, k]: the gate and up projections of position (b, t) read input row b*T + t
    routed: mx.array  # [B, T, k]: the down projection reads that position's j-th expert output


def expert_rows(layers: list[Any], tokens: mx.array) -> ExpertRows | None:
    """`ExpertRows` for a forward over `tokens` [B, T] through `layers` (a mixture of experts'
    decoder layers) whose routed positions are few enough for the library's unsorted path
    (B * T * k < 64), else None."""
    mlp = layers[0].mlp
    B, T = tokens.shape
    if not hasattr(mlp, "switch_mlp") or B * T * mlp.top_k >= 64:
        return None
    k = mlp.top_k
    return ExpertRows(mx.repeat(mx.arange(B * T, dtype=mx.uint32), k).reshape(B, T, k),
                      mx.arange(B * T * k, dtype=mx.uint32).reshape(B, T, k))


def _switch_linear(m: Any, x: mx.array, inds: mx.array, rows: mx.array) -> mx.array:
    """mlx-vlm's `SwitchLinear` / `QuantizedSwitchLinear` (unsorted, no bias) with the rows given."""
    if "scales" in m:
        return mx.gather_qmm(x, m["weight"], m["scales"], m.get("biases"), lhs_indices=rows, rhs_indices=inds,
                             transpose=True, group_size=m.group_size, bits=m.bits, mode=m.mode)
    return mx.gather_mm(x, m["weight"].swapaxes(-1, -2), lhs_indices=rows, rhs_indices=inds)


def _experts(switch: Any, x: mx.array, inds: mx.array, rows: ExpertRows | None,
             prefill: PrefillOptions | None) -> mx.array:
    """mlx-vlm's `SwitchGLU` over the routed experts: its own call; for many routed positions on a
    GPU (a prefill chunk, or a decode step given the engine's options, as its `prefill` options say),
    grouped GEMMs (`kernels.grouped_experts`); for few on a CUDA GPU, one matrix-vector product a
    pair (`kernels.pair_qmv`, unless the options keep the library's experts); or for few routed
    positions elsewhere (its unsorted path) the same matmuls, one row per position, with `rows` given."""
    if prefill is not None and prefill.grouped_experts and use_grouped(switch, inds.size, prefill.grouped_min_routes):
        return grouped_switch_glu(switch, x, inds, kernel=prefill.quantized_kernel, narrow=prefill.narrow_kernel)
    if (prefill is None or prefill.grouped_experts) and use_pairs(switch, x, inds.size):
        return pair_switch_glu(switch, x, inds)
    if rows is None or any("bias" in m for m in (switch.gate_proj, switch.up_proj, switch.down_proj)):
        return switch(x, inds)
    x = mx.expand_dims(x, (-2, -3))
    up = _switch_linear(switch.up_proj, x, inds, rows.inputs)
    gate = _switch_linear(switch.gate_proj, x, inds, rows.inputs)
    return _switch_linear(switch.down_proj, switch.activation(up, gate), inds, rows.routed).squeeze(-2)


def layer_residual(layer: Any, h: mx.array, r: mx.array, rows: ExpertRows | None = None,
              prefill: PrefillOptions | None = None) -> mx.array:
    """The residual stream after a layer whose mixer returned `r`: the mixer's output, then the MLP's."""
    h = h + r
    x = layer.post_attention_layernorm(h)
    mlp = layer.mlp
    if not hasattr(mlp, "switch_mlp"):  # a dense MLP
        return h + dense_mlp(mlp, x)
    # mlx-vlm's Qwen3_5MoeSparseMoeBlock, its router and combine through `kernels.moe`
    router, shared_gate = dense_many((mlp.gate, mlp.shared_expert_gate), x, views=True)
    inds, scores = route_topk(router, mlp.top_k, mlp.norm_topk_prob)
    return combine(h, _experts(mlp.switch_mlp, x, inds, rows, prefill), scores, shared_gate,
                   dense_mlp(mlp.shared_expert, x))


def attention_layer(layer: Any, h: mx.array, keys_buf: mx.array, values_buf: mx.array, at: Positions,
                    periods: mx.array | None = None, rows: ExpertRows | None = None
                    ) -> tuple[mx.array, mx.array, mx.array]:
    """One full-attention decoder layer outside the loop (the MTP head's): the residual stream after it."""
    r, keys_buf, values_buf = attention(layer.self_attn, layer.input_layernorm(h), keys_buf, values_buf, at, periods)
    return layer_residual(layer, h, r, rows), keys_buf, values_buf


#: A layer's mixer as the loop calls it: (the library's mixer module, the layer's normed input) -> its output.
Mixer = Callable[[Any, mx.array], mx.array]
#: A layer's residual stream after its mixer returned r, as the loop calls it: (layer, h, r) -> h
#: (`layer_residual`'s arithmetic; a small chunk's, compiled per layer: `compiled_chunk.compiled_residual`)
Residual = Callable[[Any, mx.array, mx.array], mx.array]


def run_layers(layers: list[Any], h: mx.array, linear: Mixer, attend: Mixer, rows: ExpertRows | None = None,
               *, prefill: PrefillOptions | None = None, after: Callable[[mx.array], None] | None = None,
               residual: Residual | None = None) -> mx.array:
    """The one layer loop: the residual stream after `layers`, each a GatedDeltaNet layer (its
    mixer `linear`) or an attention layer (`attend`), then its MLP (for a prefill chunk, its
    `prefill` options: the experts grouped where that pays). The mixers keep the caches (called
    in layer order); `after` sees the residual stream after each layer (an eager caller's hook);
    `residual`, where given, runs each layer's MLP in place of `layer_residual`."""
    for layer in layers:
        x = layer.input_layernorm(h)
        r = linear(layer.linear_attn, x) if layer.is_linear else attend(layer.self_attn, x)
        h = residual(layer, h, r) if residual is not None else layer_residual(layer, h, r, rows, prefill)
        if after is not None:
            after(h)
    return h


def forward_block(lm: Any, tokens: mx.array, at: Positions, kv: KV, conv: list[mx.array], ssm: list[mx.array],
                  *, keep_states: bool, stage: Stage | None, prefill: PrefillOptions | None = None
                  ) -> tuple[mx.array, KV, list[mx.array], list[mx.array]]:
    """`models.ModelFamily.forward_block`: the layer loop over explicit caches."""
    h = lm.model.embed_tokens(tokens)
    wire = h.dtype  # what a stage boundary carries in this step (`receive` takes the embedding's)
    if stage is not None:
        h = stage.enter(h)
    new_kv, new_conv, new_ssm = [], [], []
    kv_in, gdn_in = iter(kv), iter(zip(conv, ssm, strict=True))
    periods = rope_periods(lm.model.layers) if at.offsets is not None else None

    def linear(la: Any, x: mx.array) -> mx.array:
        conv_state, ssm_state = next(gdn_in)
        r, conv_state, ssm_state = gated_delta_net(la, x, conv_state, ssm_state, keep_states=keep_states)
        new_conv.append(conv_state)
        new_ssm.append(ssm_state)
        return r

    def attend(sa: Any, x: mx.array) -> mx.array:
        keys_buf, values_buf = next(kv_in)
        r, keys_buf, values_buf = attention(sa, x, keys_buf, values_buf, at, periods)
        new_kv.append((keys_buf, values_buf))
        return r

    h = run_layers(lm.model.layers, h, linear, attend, expert_rows(lm.model.layers, tokens), prefill=prefill)
    if stage is not None:  # every rank: the last stage's hidden states, every position
        h = stage.leave(h, wire)
    return lm.model.norm(h), new_kv, new_conv, new_ssm


def logits(lm: Any, hidden: mx.array) -> mx.array:
    return lm.model.embed_tokens.as_linear(hidden) if lm.args.tie_word_embeddings else dense(lm.lm_head, hidden)

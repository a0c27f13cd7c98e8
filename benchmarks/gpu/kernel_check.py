"""The GPU test of our CUDA kernels (issue 32.1): each kernel of `mlx_relay/engine/kernels/` against
its plain-MLX fallback (the library's arithmetic, which the float32 CPU tests pin greedy-exact), on
random inputs at Qwen3.5-35B-A3B's shape, bf16 as the model runs. Exits non-zero on a mismatch.

    python benchmarks/gpu/kernel_check.py [--out check.json]

- GatedDeltaNet mixer (`gated_delta.cuda_mixer` vs `fallback_mixer`): one token (the decode step)
  and a block of 3 keeping every position's state (the MTP verify round), batch 1 and 4; the conv
  window must match exactly (it is a copy), the output and the recurrent state within bf16
  rounding (relative to the largest value).
- MoE router (`moe.cuda_route_topk` vs `fallback_route_topk`): the same k largest probabilities
  per row (compared sorted: the kernel orders experts by probability, argpartition in no set
  order; equal probabilities may name other experts), each weight the renormalized probability of
  the expert it names.
- MoE combine (`moe.cuda_combine` vs `fallback_combine`).
- The attention's two products over quantized keys and values (`kernels/quantized_attention.py`) against
  their fallbacks, a block sliced from a longer buffer, 8 and 4 bits.
- The same three given their projections as strided views of one merged product
  (`merged_projections.py`; the kernels read them in place), the fallbacks row-contiguous copies.
- GatedDeltaNet prefill recurrence (`gated_delta_prefill.cuda_delta_rule` vs its `fallback`, the
  library's chunked scan, and vs the library's sequential reference `gated_delta_ops`): chunks of
  1, 100 and 2,048 positions, batch 1 and 3, with and without a padding mask (the padded
  positions' state must not move).
- The prefill's shifted conv (`chunk_mixer.depthwise_conv`) vs the library's `Conv1d`, and the grouped
  experts (`grouped_experts.grouped_switch_glu`, dequantized and through our grouped 8-bit kernel)
  and the library's 8-bit `SwitchGLU`, each against a float32 truth (`experts_truth.py`), at 256
  and 2,048 tokens of the 35B-A3B shape; the grouped kernel (`grouped_qmm`) alone and its fallback
  (dequantized weights, CUTLASS's grouped GEMM) against the truth, experts routed evenly and
  skewed, and for a few rows (those by `grouped_qmv`'s kernel, few rows an expert). (Against
  the truth, not each other: on 2026-11-28 the fallback given
  expanded rows was the wrong one, benchmarks/results/prefill-h200-2026-11-28/.)
- The experts over few pairs (`pair_qmv.cuda_pair_qmv`, one product a pair; `pair_switch_glu` and the
  library's `SwitchGLU`) against the float32 truth at the decode step's and the verify block's shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
from build_random_model import TEXT_35B_A3B  # beside this script (benchmarks/gpu/)
from experts_truth import float_weights, quantized_switch, truth

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import cuda_mixer, fallback_mixer
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_prefill import cuda_delta_rule
from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_prefill import fallback as delta_rule_fallback
from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import grouped_switch_glu
from mlx_relay.engine.models.qwen3_5.kernels.moe import (
    cuda_combine,
    cuda_route_topk,
    fallback_combine,
    fallback_route_topk,
)

TOLERANCE = 2e-2  # relative to the reference's largest magnitude: a few bf16 roundings (eps 2^-7)

# one layer of the model the GPU runs use (`build_random_model.py`'s public config figures)
SHAPE = {**TEXT_35B_A3B, "num_hidden_layers": 1, "vocab_size": 1024}


def rel(a: mx.array, ref: mx.array) -> float:
    a, ref = a.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(a - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6))


def gated_delta_net() -> Any:
    from mlx_vlm.models.qwen3_5_moe.config import TextConfig
    from mlx_vlm.models.qwen3_5_moe.language import Qwen3_5MoeGatedDeltaNet

    la = Qwen3_5MoeGatedDeltaNet(TextConfig.from_dict(SHAPE))
    la.update({"conv1d": {"weight": (mx.random.normal(la.conv1d.weight.shape) * 0.3).astype(mx.bfloat16)},
               "A_log": mx.random.normal((la.num_v_heads,)) * 0.5,
               "dt_bias": (mx.random.normal((la.num_v_heads,)) * 0.5).astype(mx.bfloat16),
               "norm": {"weight": (1 + 0.1 * mx.random.normal((la.head_v_dim,))).astype(mx.bfloat16)}})
    mx.eval(la.parameters())
    return la


def merged_views(lead: tuple[int, ...], widths: tuple[int, ...], scale: float = 1.0) -> tuple[mx.array, ...]:
    """Random bf16 parts [*lead, width] as views of one product, the way `merged_projections` splits
    a merged projection (each part's rows strided by the whole width, 16 padding columns at the end)."""
    whole = (mx.random.normal((*lead, sum(widths) + 16)) * scale).astype(mx.bfloat16)
    mx.eval(whole)
    cuts = [sum(widths[:i + 1]) for i in range(len(widths))]
    return tuple(mx.split(whole, cuts, axis=-1))[:len(widths)]


def check_mixer(la: Any, B: int, T: int, keep: bool, strided: bool = False) -> dict[str, Any]:
    """`strided`: the four projections as views of one merged product (read in place by the kernel),
    the fallback given row-contiguous copies."""
    C = 2 * la.key_dim + la.value_dim
    K = la.conv1d.weight.shape[1]
    bf = mx.bfloat16
    if strided:
        qkv, z, b, a = merged_views((B, T), (C, la.value_dim, la.num_v_heads, la.num_v_heads))
    else:
        qkv = mx.random.normal((B, T, C)).astype(bf)
        z = mx.random.normal((B, T, la.value_dim)).astype(bf)
        b = mx.random.normal((B, T, la.num_v_heads)).astype(bf)
        a = mx.random.normal((B, T, la.num_v_heads)).astype(bf)
    conv = mx.random.normal((B, K - 1, C)).astype(bf)
    ssm = mx.random.normal((B, la.num_v_heads, la.head_v_dim, la.head_k_dim)) * 0.05
    mx.eval(qkv, z, b, a, conv, ssm)
    ours = cuda_mixer(la, qkv, z, b, a, conv, ssm, keep_states=keep)
    ref = fallback_mixer(la, *(mx.contiguous(t) for t in (qkv, z, b, a)), conv, ssm, keep_states=keep)
    mx.eval(ours, ref)
    shapes_ok = all(o.shape == r.shape and o.dtype == r.dtype for o, r in zip(ours, ref, strict=True))
    result = {"B": B, "T": T, "keep_states": keep, "strided": strided, "shapes_match": shapes_ok,
              "y_rel": rel(ours[0], ref[0]) if shapes_ok else None,
              "conv_exact": bool(mx.array_equal(ours[1], ref[1])) if shapes_ok else False,
              "ssm_rel": rel(ours[2], ref[2]) if shapes_ok else None}
    result["ok"] = bool(shapes_ok and result["conv_exact"] and result["y_rel"] <= TOLERANCE
                        and result["ssm_rel"] <= TOLERANCE)
    return result


def check_quantized_attention(B: int, R: int, bits: int, L: int = 1000, D: int = 256, H: int = 2) -> dict[str, Any]:
    """The two products over quantized keys and values (`kernels/quantized_attention.py`) against their
    fallbacks (a float copy and MLX's matmuls), on a block sliced from a longer buffer (read in place)."""
    from mlx_relay.engine.kernels import quantized_attention as qa

    bf = mx.bfloat16
    buf = [mx.quantize(mx.random.normal((B, H, L, D)).astype(bf), group_size=64, bits=bits) for _ in range(2)]
    keys, values = (tuple(x[:, :, 100:L - 100] for x in b) for b in buf)
    q = (mx.random.normal((B, H, R, D)) * 0.05).astype(bf)
    p = mx.softmax(mx.random.normal((B, H, R, L - 200)) * 3, axis=-1)
    ours_s, ref_s = qa.quantized_scores(q, keys, bits, 64), qa.fallback_scores(q, keys, bits, 64)
    ours_w, ref_w = qa.quantized_weighted(p, values, bits, 64, bf), qa.fallback_weighted(p, values, bits, 64, bf)
    mx.eval(ours_s, ref_s, ours_w, ref_w)
    result = {"B": B, "R": R, "bits": bits, "keys": L - 200, "fits": qa.fits(R, D, bits, 64),
              "scores_rel": rel(ours_s, ref_s), "weighted_rel": rel(ours_w, ref_w),
              "shapes_match": ours_s.shape == ref_s.shape and ours_w.shape == ref_w.shape}
    result["ok"] = bool(result["fits"] and result["shapes_match"] and result["scores_rel"] <= TOLERANCE
                        and result["weighted_rel"] <= TOLERANCE)
    return result


def check_route(B: int, E: int = 256, k: int = 8, T: int = 1, strided: bool = False) -> dict[str, Any]:
    """`strided`: the logits a view of a merged product (the router's and the shared expert's gate)."""
    logits = merged_views((B, T), (E, 1), 2.0)[0] if strided else (mx.random.normal((B, T, E)) * 2).astype(mx.bfloat16)
    inds, scores = cuda_route_topk(logits, k, True)
    ref_inds, ref_scores = fallback_route_topk(logits, k, True)
    probs = mx.softmax(logits, axis=-1, precise=True)
    named = mx.take_along_axis(probs, inds.astype(mx.int32), axis=-1)
    named = named / named.sum(axis=-1, keepdims=True)
    mx.eval(inds, scores, ref_inds, ref_scores, named)
    result = {"B": B, "T": T, "E": E, "k": k, "strided": strided,
              "sorted_scores_rel": rel(mx.sort(scores, axis=-1), mx.sort(ref_scores, axis=-1)),
              "scores_are_named_experts_rel": rel(scores, named),
              "distinct_experts": bool(all(len(set(r)) == k for r in inds.reshape(-1, k).tolist())),
              "same_expert_sets": [sorted(x) for x in inds.reshape(-1, k).tolist()]
              == [sorted(x) for x in ref_inds.reshape(-1, k).tolist()]}
    result["ok"] = bool(result["distinct_experts"] and result["sorted_scores_rel"] <= TOLERANCE
                        and result["scores_are_named_experts_rel"] <= TOLERANCE)
    return result


def check_combine(B: int, D: int = 2048, k: int = 8, T: int = 1, strided: bool = False) -> dict[str, Any]:
    """`strided`: the shared expert's gate a view of a merged product (beside the router's 256 columns)."""
    bf = mx.bfloat16
    h = mx.random.normal((B, T, D)).astype(bf)
    y = mx.random.normal((B, T, k, D)).astype(bf)
    scores = mx.softmax(mx.random.normal((B, T, k)), axis=-1).astype(bf)
    gate = merged_views((B, T), (256, 1))[1] if strided else mx.random.normal((B, T, 1)).astype(bf)
    shared = mx.random.normal((B, T, D)).astype(bf)
    ours = cuda_combine(h, y, scores, gate, shared)
    ref = fallback_combine(h, y, scores, mx.contiguous(gate), shared)
    result = {"B": B, "T": T, "strided": strided, "rel": rel(ours, ref),
              "shape_match": ours.shape == ref.shape and ours.dtype == ref.dtype}
    result["ok"] = bool(result["shape_match"] and result["rel"] <= TOLERANCE)
    return result


def check_delta_rule(la: Any, B: int, T: int, masked: bool) -> dict[str, Any]:
    from mlx_vlm.models.qwen3_5.gated_delta import compute_g, gated_delta_ops

    bf = mx.bfloat16
    Hk, Hv, Dk, Dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    q = mx.random.normal((B, T, Hk, Dk)).astype(bf) * (Dk ** -1.0)
    k = mx.random.normal((B, T, Hk, Dk)).astype(bf) * (Dk ** -0.5)
    v = mx.random.normal((B, T, Hv, Dv)).astype(bf)
    a = mx.random.normal((B, T, Hv)).astype(bf)
    b = mx.random.normal((B, T, Hv)).astype(bf)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.05
    mask = None
    if masked:  # the last row right-padded after T // 2 positions
        mask = mx.ones((B, T), dtype=mx.bool_)
        mask[B - 1, T // 2:] = False
    g, beta = compute_g(la.A_log, a, la.dt_bias), mx.sigmoid(b)
    ours = cuda_delta_rule(q, k, v, g, beta, state, mask)
    ref = delta_rule_fallback(q, k, v, a, b, la.A_log, la.dt_bias, state, mask, None)
    seq = gated_delta_ops(q, k, v, g, beta, state, mask)
    mx.eval(ours, ref, seq)
    real = mx.ones((B, T, 1, 1), dtype=mx.bool_) if mask is None else mask[:, :, None, None]
    result = {"B": B, "T": T, "masked": masked,
              "y_rel_chunked": rel(mx.where(real, ours[0], 0), mx.where(real, ref[0], 0)),
              "y_rel_sequential": rel(mx.where(real, ours[0], 0), mx.where(real, seq[0], 0)),
              "state_rel_chunked": rel(ours[1], ref[1]), "state_rel_sequential": rel(ours[1], seq[1])}
    result["ok"] = bool(max(result["y_rel_sequential"], result["state_rel_sequential"]) <= TOLERANCE
                        and max(result["y_rel_chunked"], result["state_rel_chunked"]) <= TOLERANCE)
    return result


def check_conv(la: Any, T: int) -> dict[str, Any]:
    from mlx_relay.engine.models.qwen3_5.chunk_mixer import depthwise_conv

    C = 2 * la.key_dim + la.value_dim
    conv_in = mx.random.normal((1, la.conv_kernel_size - 1 + T, C)).astype(mx.bfloat16)
    ours, ref = depthwise_conv(la, conv_in, T), la.conv1d(conv_in)
    mx.eval(ours, ref)
    result = {"T": T, "rel": rel(ours, ref), "shape_match": ours.shape == ref.shape and ours.dtype == ref.dtype}
    result["ok"] = bool(result["shape_match"] and result["rel"] <= TOLERANCE)
    return result


def check_grouped_qmm(T: int, skewed: bool) -> dict[str, Any]:
    """Our grouped 8-bit kernel and its fallback (dequantized weights, MLX's sorted gather_mm), each
    against a float32 truth (`experts_truth.float_weights`, one matmul per expert), the up
    projection's shape and the down projection's, experts routed evenly or most rows to a few
    experts (many tiles of one expert, many experts without a row)."""
    from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import fallback as qmm_fallback
    from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import grouped_qmm

    H, F = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"]
    E, k = SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    switch = quantized_switch()
    n = T * k
    experts = (mx.random.randint(0, 3, (n,)) if skewed else mx.random.randint(0, E, (n,))).astype(mx.uint32)
    experts = mx.sort(experts)
    from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import FEW_ROWS_AN_EXPERT

    result: dict[str, Any] = {"T": T, "skewed": skewed, "kernel": "qmv" if n <= FEW_ROWS_AN_EXPERT * E else "qmm"}
    ok = True
    for name, proj, K in (("up", switch.up_proj, H), ("down", switch.down_proj, F)):
        rows = mx.random.normal((n, 1, K)).astype(mx.bfloat16)
        ours, ref = grouped_qmm(rows, proj, experts), qmm_fallback(rows, proj, experts)
        true = projection_truth(rows, proj, experts)
        mx.eval(ours, ref, true)
        result[f"{name}_rel"], result[f"{name}_fallback_rel"] = rel(ours, true), rel(ref, true)
        ok = ok and ours.shape == ref.shape and max(result[f"{name}_rel"], result[f"{name}_fallback_rel"]) <= TOLERANCE
    result["ok"] = bool(ok)
    return result


def check_narrow_qmm(T: int, skewed: bool, dense: bool = False, split_k: int = 1, stages: int = 4) -> dict[str, Any]:
    """`narrow_qmm`'s tensor-core kernel against the float32 truth,
    the up and down projections' shapes: routed rows (evenly, or most to a few experts: a pass per
    8 rows), or `dense`: T rows through one expert's weights (a dense projection, E = 1)."""
    from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_qmm

    E, k = SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    switch = quantized_switch()
    result: dict[str, Any] = {"T": T, "skewed": skewed, "dense": dense, "split_k": split_k, "stages": stages}
    ok = True
    for name, proj, K in (("up", switch.up_proj, SHAPE["hidden_size"]), ("down", switch.down_proj,
                                                                        SHAPE["moe_intermediate_size"])):
        if dense:
            proj = {key: proj[key][3:4] for key in ("weight", "scales", "biases")}
            n = T
            experts = mx.zeros((n,), dtype=mx.uint32)
        else:
            n = T * k
            experts = (mx.random.randint(0, 3, (n,)) if skewed else mx.random.randint(0, E, (n,))).astype(mx.uint32)
            experts = mx.sort(experts)
        rows = mx.random.normal((n, 1, K)).astype(mx.bfloat16)
        ours = cuda_narrow_qmm(rows, proj, experts, split_k=split_k, stages=stages)
        true = projection_truth(rows, proj, experts)
        mx.eval(ours, true)
        result[f"{name}_rel"] = rel(ours, true)
        ok = ok and ours.shape == (n, 1, proj["weight"].shape[1]) and result[f"{name}_rel"] <= TOLERANCE
    result["ok"] = bool(ok)
    return result


def check_narrow_linear(M: int, N: int, K: int, split_k: int) -> dict[str, Any]:
    """`narrow_qmm.cuda_narrow_linear` (a dense 8-bit projection over M rows: the decode step's) against
    the float32 truth, and MLX's `quantized_matmul` (what the library's `QuantizedLinear` runs) beside it."""
    import mlx.nn as nn

    from mlx_relay.engine.models.qwen3_5.kernels.narrow_qmm import cuda_narrow_linear

    lin = nn.QuantizedLinear.from_linear(nn.Linear(K, N, bias=False), group_size=64, bits=8)
    weight, scales, biases = lin.weight, lin.scales.astype(mx.bfloat16), lin.biases.astype(mx.bfloat16)
    x = mx.random.normal((M, K)).astype(mx.bfloat16)
    ours = cuda_narrow_linear(x, weight, scales, biases, split_k=split_k)
    library = mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=64, bits=8)
    true = x.astype(mx.float32) @ float_weights_of({"weight": weight, "scales": scales, "biases": biases}).T
    mx.eval(ours, library, true)
    result: dict[str, Any] = {"M": M, "N": N, "K": K, "split_k": split_k, "rel": rel(ours, true),
                              "library_rel": rel(library, true)}
    result["ok"] = bool(ours.shape == (M, N) and result["rel"] <= TOLERANCE)
    return result


def check_tiles(R: int, skewed: bool, rt: int) -> dict[str, Any]:
    """`expert_tiles.tiles`'s one-launch offsets (tiles of `rt` rows: narrow_qmm's 8, grouped_qmm's 64)
    against numpy's prefix sums."""
    import numpy as np

    from mlx_relay.engine.models.qwen3_5.kernels.expert_tiles import tiles

    E = SHAPE["num_experts"]
    experts = mx.sort((mx.random.randint(0, 3, (R,)) if skewed else mx.random.randint(0, E, (R,))).astype(mx.uint32))
    at = tiles(experts, E, rt)
    counts = np.bincount(np.array(experts.tolist(), dtype=np.int64), minlength=E)
    rows_ok = at.row_off.tolist() == [0, *np.cumsum(counts).tolist()]
    tiles_ok = at.tile_off.tolist() == [0, *np.cumsum((counts + rt - 1) // rt).tolist()]
    return {"R": R, "skewed": skewed, "rows_a_tile": rt, "row_off": rows_ok, "tile_off": tiles_ok,
            "ok": bool(rows_ok and tiles_ok)}


def projection_truth(rows: mx.array, proj: Any, experts: mx.array) -> mx.array:
    """rows[r] @ W[experts[r]]^T in float32, one matmul per expert."""
    import numpy as np

    w = float_weights(proj) if hasattr(proj, "bits") else float_weights_of(proj)
    out = mx.zeros((rows.shape[0], 1, w.shape[1]), dtype=mx.float32)
    ids = np.array(experts.astype(mx.int32))
    for e in sorted(set(ids.tolist())):
        at = mx.array(np.nonzero(ids == e)[0].astype(np.int32))
        out[at] = rows[at].astype(mx.float32) @ w[e].T
        mx.eval(out)
    return out


def float_weights_of(proj: dict[str, mx.array]) -> mx.array:
    """A projection's 8-bit weights (group 64, as the switch's) dequantized in float32."""
    return mx.dequantize(proj["weight"], proj["scales"].astype(mx.float32), proj["biases"].astype(mx.float32),
                         group_size=64, bits=8)


def check_grouped_experts(T: int, kernel: bool, narrow: bool = False) -> dict[str, Any]:
    """The grouped experts (dequantized for CUTLASS's grouped GEMM, or our kernel; `narrow`: few rows
    an expert on `narrow_qmm`'s tensor cores, CUDA's default) and the library's 8-bit `SwitchGLU`,
    each against the float32 truth (`experts_truth.truth`)."""
    H, E, k = SHAPE["hidden_size"], SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    switch = quantized_switch()
    x = mx.random.normal((1, T, H)).astype(mx.bfloat16)
    inds = mx.argpartition(mx.random.normal((1, T, E)), kth=-k, axis=-1)[..., -k:].astype(mx.uint32)
    ours = grouped_switch_glu(switch, x, inds, kernel=kernel, narrow=narrow)
    ref, true = switch(x, inds), truth(switch, x, inds)
    mx.eval(ours, ref, true)
    result = {"T": T, "kernel": kernel, "narrow": narrow, "rel": rel(ours, true), "library_rel": rel(ref, true),
              "shape_match": ours.shape == ref.shape and ours.dtype == ref.dtype}
    result["ok"] = bool(result["shape_match"] and max(result["rel"], result["library_rel"]) <= TOLERANCE)
    return result

def check_pair_qmv(P: int, per_row: int, skewed: bool) -> dict[str, Any]:
    """`pair_qmv`'s kernel (one product a pair: the decode step's and the MTP round's experts) against the
    float32 truth, the up projection's shape and the down projection's, `per_row` pairs sharing an input
    row (a token's k experts), experts spread or all pairs on a few."""
    from mlx_relay.engine.models.qwen3_5.kernels.pair_qmv import cuda_pair_qmv

    H, F, E = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    switch = quantized_switch()
    experts = (mx.random.randint(0, 3, (P,)) if skewed else mx.random.randint(0, E, (P,))).astype(mx.uint32)
    result: dict[str, Any] = {"P": P, "per_row": per_row, "skewed": skewed}
    ok = True
    for name, proj, K, share in (("up", switch.up_proj, H, per_row), ("down", switch.down_proj, F, 1)):
        rows = mx.random.normal((P // share, K)).astype(mx.bfloat16)
        ours = cuda_pair_qmv(rows, proj, experts, share)
        true = projection_truth(mx.repeat(rows, share, axis=0)[:, None, :], proj, experts)[:, 0, :]
        mx.eval(ours, true)
        result[f"{name}_rel"] = rel(ours, true)
        ok = ok and ours.shape == (P, true.shape[-1]) and result[f"{name}_rel"] <= TOLERANCE
    result["ok"] = bool(ok)
    return result


def check_pair_experts(B: int, T: int) -> dict[str, Any]:
    """`pair_switch_glu` (the layer loop's experts over few pairs on a CUDA GPU) and the library's 8-bit
    `SwitchGLU`, each against the float32 truth, at the decode step's and the verify block's shapes."""
    from mlx_relay.engine.models.qwen3_5.kernels.pair_qmv import pair_switch_glu

    H, E, k = SHAPE["hidden_size"], SHAPE["num_experts"], SHAPE["num_experts_per_tok"]
    switch = quantized_switch()
    x = mx.random.normal((B, T, H)).astype(mx.bfloat16)
    inds = mx.argpartition(mx.random.normal((B, T, E)), kth=-k, axis=-1)[..., -k:].astype(mx.uint32)
    ours = pair_switch_glu(switch, x, inds)
    ref, true = switch(x, inds), truth(switch, x, inds)
    mx.eval(ours, ref, true)
    result = {"B": B, "T": T, "rel": rel(ours, true), "library_rel": rel(ref, true),
              "shape_match": ours.shape == ref.shape and ours.dtype == ref.dtype}
    result["ok"] = bool(result["shape_match"] and max(result["rel"], result["library_rel"]) <= TOLERANCE)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not cuda_kernels_available():
        sys.exit("kernel_check: no CUDA GPU here (the kernels run only there; the CPU tests pin the fallbacks)")
    mx.random.seed(0)
    la = gated_delta_net()
    checks: dict[str, list[dict[str, Any]]] = {"gated_delta_mixer": [], "route_topk": [], "combine": [],
                                               "delta_rule": [], "conv": [], "grouped_experts": [],
                                               "grouped_qmm": [], "narrow_qmm": [], "pair_qmv": [],
                                               "quantized_attention": []}
    def record(name: str, check: Any, *args: Any) -> None:
        try:
            c = check(*args)
        except Exception as exc:  # a kernel that does not compile or run fails the check, the others still run
            c = {"args": repr(args[1:] if name in ("gated_delta_mixer", "delta_rule", "conv") else args),
                 "error": repr(exc)[:2000],
                 "ok": False}
        checks[name].append(c)
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in c.items() if k != "same_expert_sets"), flush=True)

    for B in (1, 4):
        for T, keep in ((1, False), (3, True), (2, False)):
            record("gated_delta_mixer", check_mixer, la, B, T, keep)
        record("route_topk", check_route, B)
        record("combine", check_combine, B)
    # the parts of merged projections read in place (`dense.dense_many(..., views=True)`): the mixed
    # step's decoding rows (B rows of one position, split from a slice's product) and a verify block
    for B, T, keep in ((1, 1, False), (8, 1, False), (2, 3, True)):
        record("gated_delta_mixer", check_mixer, la, B, T, keep, True)
    # the attention's products over a quantized KV cache, read in place (--kv-bits on CUDA, long contexts):
    # one position and a 2-position verify of a 16-head / 2-key-head model (8 and 16 rows a key head)
    for B, R, bits in ((1, 8, 8), (3, 16, 8), (2, 8, 4)):
        record("quantized_attention", check_quantized_attention, B, R, bits)
    for B, T in ((1, 1), (8, 1), (1, 24), (3, 7)):
        record("route_topk", check_route, B, 256, 8, T, True)
        record("combine", check_combine, B, 2048, 8, T, True)
    for B, T, masked in ((1, 1, False), (1, 100, False), (1, 2048, False), (3, 100, True), (3, 2048, True)):
        record("delta_rule", check_delta_rule, la, B, T, masked)
    record("conv", check_conv, la, 2048)
    for T in (256, 2048):
        for kernel in (False, True):
            record("grouped_experts", check_grouped_experts, T, kernel)
    # CUDA's default experts (narrow up to 32 rows an expert: 256 and 1,024 tokens over 256 experts)
    for T in (64, 256, 1024):
        record("grouped_experts", check_grouped_experts, T, True, True)
    # 2,048 tokens: the tensor-core kernel; 512 and fewer: grouped_qmv's (few rows an expert; skewed:
    # a few experts with hundreds of rows, a pass per 8)
    for T, skewed in ((2048, False), (2048, True), (512, False), (256, False), (256, True), (37, False), (1, False)):
        record("grouped_qmm", check_grouped_qmm, T, skewed)
    # the dense projections over 8-32 rows (kernels/dense.py) and the narrow experts (CUDA's default: up to
    # 32 rows an expert, 1,024 tokens)
    for T, skewed, dense, split, stages in (
            (1, False, False, 1, 4), (37, False, False, 1, 4), (256, False, False, 1, 4), (256, True, False, 1, 4),
            (1024, False, False, 1, 4), (1024, True, False, 1, 4),
            (256, True, False, 1, 3), (64, False, False, 1, 1), (1, False, True, 1, 4), (8, False, True, 4, 4),
            (13, False, True, 2, 2), (13, False, True, 4, 4)):
        record("narrow_qmm", check_narrow_qmm, T, skewed, dense, split, stages)
    for R, skewed, rt in ((1, False, 8), (576, False, 8), (2112, True, 8), (2112, False, 64), (16384, True, 64)):
        record("narrow_qmm", check_tiles, R, skewed, rt)
    for M, N, K, split in ((1, 8192, 2048, 4), (2, 8192, 2048, 4), (8, 2048, 4096, 4), (5, 512, 2048, 2),
                           (16, 8192, 2048, 4), (3, 2048, 512, 1), (24, 8192, 2048, 4), (32, 2048, 4096, 4),
                           (29, 512, 2048, 4)):
        record("narrow_qmm", check_narrow_linear, M, N, K, split)
    # the experts over few pairs (kernels/pair_qmv.py): decode of 1, 8 and 16 rows, a verify block of 2
    # and 4, a 16-token slice beside 8 rows; one input row a pair (down) and a token's 8 (up)
    for P, per_row, skewed in ((8, 8, False), (16, 8, False), (64, 8, False), (64, 8, True), (192, 8, False),
                               (256, 1, False), (8, 1, True)):
        record("pair_qmv", check_pair_qmv, P, per_row, skewed)
    for B, T in ((1, 1), (8, 1), (16, 1), (1, 2), (1, 4), (2, 3)):
        record("pair_qmv", check_pair_experts, B, T)
    ok = all(c["ok"] for group in checks.values() for c in group)
    print("kernel check: " + ("PASS" if ok else "FAIL"))
    if args.out:
        args.out.write_text(json.dumps({"tolerance": TOLERANCE, "checks": checks, "pass": ok}, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Which path of a mixture of experts' routed matmuls is right on this device (issue 43.2): each
against a float32 truth built from plain ops (the 8-bit weights dequantized in float32, one matmul
per expert), at the 35B-A3B shape.

    python benchmarks/gpu/experts_truth.py [--tokens 256,2048] [--out truth.json]

Paths: `library` (mlx-vlm's 8-bit `SwitchGLU`: MLX's gather_qmm), `dequantize` (our grouped
experts, each projection dequantized for MLX's sorted gather_mm), `kernel` (our grouped 8-bit
kernel), and two variants of the sorted gather_mm's input (`gather_mm_expanded`: rows [R, K]
given as [R, 1, K] by indexing, as `grouped_qmm.fallback` does; `gather_mm_gathered`: [R, 1, K]
made by the gather itself, as the path was before 5259b89). Prints each path's relative error
(max |path - truth| / max |truth|, bf16 paths: a few 2^-8 is right; ~1 is wrong).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

SHAPE = {"hidden_size": 2048, "moe_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8}


def quantized_switch() -> Any:
    """One mixture of experts' `SwitchGLU` at the 35B-A3B shape, random bf16 weights, 8-bit g64."""
    import mlx.nn as nn
    from mlx_vlm.models.switch_layers import SwitchGLU

    H, F, E = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"]
    switch = SwitchGLU(H, F, E)
    switch.update({name: {"weight": (mx.random.normal((E, *shape)) * 0.02).astype(mx.bfloat16)}
                   for name, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F)))})
    nn.quantize(switch, group_size=64, bits=8)
    return switch


def float_weights(m: Any) -> mx.array:
    """A quantized projection's weights [E, out, in] dequantized in float32."""
    return mx.dequantize(m["weight"], m["scales"].astype(mx.float32), m["biases"].astype(mx.float32),
                         group_size=m.group_size, bits=m.bits)


def truth(switch: Any, x: mx.array, inds: mx.array) -> mx.array:
    """[T, k, H] float32: each (token, expert) pair through that expert's float32 weights."""
    H = x.shape[-1]
    xs = x.reshape(-1, H).astype(mx.float32)
    flat = inds.reshape(-1)
    k = inds.shape[-1]
    wg, wu, wd = (float_weights(m) for m in (switch.gate_proj, switch.up_proj, switch.down_proj))
    out = mx.zeros((flat.size, H), dtype=mx.float32)
    import numpy as np

    experts = np.array(flat.astype(mx.int32))
    for e in sorted(set(experts.tolist())):
        pairs = mx.array(np.nonzero(experts == e)[0].astype(np.int32))
        rows = xs[pairs // k]
        gate, up = rows @ wg[e].T, rows @ wu[e].T
        hidden = gate * mx.sigmoid(gate) * up
        out[pairs] = hidden @ wd[e].T
        mx.eval(out)
    return out.reshape(*inds.shape, H)


def rel(a: mx.array, ref: mx.array) -> float:
    a, ref = a.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(a - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-6))


def sorted_gather(switch: Any, x: mx.array, inds: mx.array, gathered: bool) -> mx.array:
    from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import expert_weights

    k = inds.shape[-1]
    flat = inds.flatten()
    order = mx.argsort(flat)
    experts = flat[order]
    H = x.shape[-1]

    def project(m: Any, a: mx.array) -> mx.array:
        return mx.gather_mm(a, expert_weights(m).swapaxes(-1, -2), rhs_indices=experts, sorted_indices=True)

    rows = x.reshape(-1, 1, H)[order // k] if gathered else x.reshape(-1, H)[order // k][:, None, :]
    out = project(switch.down_proj, switch.activation(project(switch.up_proj, rows), project(switch.gate_proj, rows)))
    return out[mx.argsort(order)].reshape(*inds.shape, H)


PATHS = ("library", "dequantize", "kernel", "gather_mm_expanded", "gather_mm_gathered")


def run_path(name: str, switch: Any, x: mx.array, inds: mx.array) -> mx.array:
    from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import grouped_switch_glu

    if name == "library":
        return switch(x, inds)
    if name in ("dequantize", "kernel"):
        return grouped_switch_glu(switch, x, inds, kernel=name == "kernel")
    return sorted_gather(switch, x, inds, gathered=name == "gather_mm_gathered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="256,2048")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    mx.random.seed(0)
    switch = quantized_switch()
    E, k, H = SHAPE["num_experts"], SHAPE["num_experts_per_tok"], SHAPE["hidden_size"]
    report = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = mx.random.normal((1, T, H)).astype(mx.bfloat16)
        inds = mx.argpartition(mx.random.normal((1, T, E)), kth=-k, axis=-1)[..., -k:].astype(mx.uint32)
        ref = truth(switch, x, inds)
        row: dict[str, Any] = {"tokens": T}
        for name in PATHS:
            try:
                y = run_path(name, switch, x, inds)
                mx.eval(y)
                row[name] = rel(y, ref)
            except Exception as exc:
                row[name] = repr(exc)[:300]
        report.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

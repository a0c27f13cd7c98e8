"""Which single ops pay a first-call cost for each new row count N on MLX's CUDA backend (issue
43.3: a mixed step's new shapes), at the 35B-A3B shape's widths:

    python benchmarks/gpu/first_shape_ops.py

For N = 1000 (twice), then 1001..1006 (each new): an 8-bit quantized projection, bfloat16
projections (H -> 1, H -> 256), the RMS norm, the router's top-k, an argsort of the routed pairs,
our grouped experts (`kernels.grouped_experts`), the GatedDeltaNet's depthwise conv (the
library's `Conv1d`, cuDNN on CUDA) and a causal attention, each evaluated and synchronized alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.switch_layers import SwitchGLU

from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import grouped_switch_glu

H = 2048


def timed(label: str, fn: Callable[..., mx.array], *args: object) -> None:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn(*args))
    mx.synchronize()
    print(f"{label:34s} {(time.perf_counter() - t0) * 1000:9.1f} ms", flush=True)


def main() -> None:
    q = nn.QuantizedLinear(H, 4096, bias=False, group_size=64, bits=8)
    d = nn.Linear(H, 1, bias=False)
    g = nn.Linear(H, 256, bias=False)
    norm = nn.RMSNorm(H)
    sw = SwitchGLU(H, 512, 256)
    nn.quantize(sw, group_size=64, bits=8)
    conv = nn.Conv1d(8192, 8192, 4, groups=8192, bias=False)
    for m in (d, g, sw, conv):
        m.set_dtype(mx.bfloat16)
    mx.eval(q.parameters(), d.parameters(), g.parameters(), sw.parameters(), conv.parameters())
    for n in (1000, 1000, 1001, 1002, 1003, 1004, 1005, 1006):
        x = mx.random.normal((1, n, H)).astype(mx.bfloat16)
        inds = mx.random.randint(0, 256, (1, n, 8)).astype(mx.uint32)
        xc = mx.random.normal((1, n + 3, 8192)).astype(mx.bfloat16)
        qkv = [mx.random.normal((1, h, n, 256)).astype(mx.bfloat16) for h in (16, 2, 2)]
        mx.eval(x, inds, xc, qkv)
        print(f"N={n}")
        timed("  qmm 8-bit Linear", q, x)
        timed("  bf16 Linear H->1", d, x)
        timed("  bf16 Linear H->256", g, x)
        timed("  rms norm", norm, x)
        timed("  argpartition/topk", lambda a: mx.argpartition(g(a), kth=-8, axis=-1)[..., -8:], x)
        timed("  argsort N*8", lambda a: mx.argsort(a.flatten()), inds)
        timed("  grouped experts (ours)", grouped_switch_glu, sw, x, inds)
        timed("  depthwise conv1d (cuDNN)", conv, xc)
        timed("  sdpa causal", lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.06,
                                                                                   mask="causal"), *qkv)


if __name__ == "__main__":
    main()

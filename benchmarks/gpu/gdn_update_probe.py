"""One GatedDeltaNet decode update at Qwen3.5-35B-A3B's shape (B rows, 16 key heads, 32 value
heads, 128x128 state, one token): mlx-vlm's `gated_delta_update` (ops on CUDA) against MLX's own
`mx.fast.gated_delta_update`, each compiled into a 30-layer chain as the decode step runs them;
ms per chain and whether the outputs agree.

    python benchmarks/gpu/gdn_update_probe.py
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_vlm.models.qwen3_5.gated_delta import compute_g, gated_delta_update


def chain(fast: bool, layers: int = 30):
    def run(q, k, v, a, b, A_log, dt_bias, states):
        outs, new = [], []
        for s in states:
            if fast:
                g = compute_g(A_log, a, dt_bias)
                y, s2 = mx.fast.gated_delta_update(q, k, v, g, mx.sigmoid(b), s)
            else:
                y, s2 = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=s)
            outs.append(y)
            new.append(s2)
        return outs, new
    return mx.compile(run)


def main() -> None:
    for B in (1, 4):
        mx.random.seed(0)
        Hk, Hv, D = 16, 32, 128
        q = mx.random.normal((B, 1, Hk, D)).astype(mx.bfloat16) * 0.1
        k = mx.random.normal((B, 1, Hk, D)).astype(mx.bfloat16) * 0.1
        v = mx.random.normal((B, 1, Hv, D)).astype(mx.bfloat16)
        a = mx.random.normal((B, 1, Hv)).astype(mx.bfloat16)
        b = mx.random.normal((B, 1, Hv)).astype(mx.bfloat16)
        A_log = mx.random.normal((Hv,)) * 0.1
        dt_bias = mx.random.normal((Hv,)) * 0.1
        states = [mx.random.normal((B, Hv, D, D)) * 0.01 for _ in range(30)]
        mx.eval(q, k, v, a, b, A_log, dt_bias, *states)
        results = {}
        for name, fast in (("mlx_vlm ops", False), ("mx.fast", True)):
            fn = chain(fast)
            try:
                out = fn(q, k, v, a, b, A_log, dt_bias, states)
                mx.eval(out)
            except Exception as exc:
                print(f"B={B} {name}: {type(exc).__name__}: {exc}")
                continue
            times = []
            for _ in range(20):
                tic = time.perf_counter()
                mx.eval(fn(q, k, v, a, b, A_log, dt_bias, states))
                times.append(time.perf_counter() - tic)
            results[name] = out
            print(f"B={B} {name}: {sorted(times)[10] * 1e3:.2f} ms per 30 updates", flush=True)
        if len(results) == 2:
            (y0, s0), (y1, s1) = results.values()
            dy = max(mx.max(mx.abs(a_.astype(mx.float32) - b_.astype(mx.float32))).item()
                     for a_, b_ in zip(y0, y1, strict=True))
            ds = max(mx.max(mx.abs(a_ - b_)).item() for a_, b_ in zip(s0, s1, strict=True))
            print(f"B={B} max |dy| {dy:.3g}, max |dstate| {ds:.3g}")


if __name__ == "__main__":
    main()

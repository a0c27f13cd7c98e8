"""The CPU's GatedDeltaNet recurrence (`engine/models/qwen3_5/kernels/gated_delta_cpu.py`) is the library's: both
forms (position by position under 16 positions, chunkwise from there) against mlx-vlm's sequential
reference `gated_delta_ops`, float32, from a nonzero state, with grouped heads, padding masked and
gates that underflow to 0."""

from __future__ import annotations

from collections.abc import Callable

import pytest

TOL = 1e-4  # float32: the same arithmetic in another order (the states are ~1-10 here)


@pytest.mark.parametrize("T", [1, 9, 37, 64, 150])
@pytest.mark.parametrize("masked", [False, True])
def test_both_forms_equal_the_librarys_sequential_recurrence(gpu: Callable, T: int, masked: bool) -> None:
    def run() -> tuple[float, float, float]:
        import mlx.core as mx
        from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_ops

        from mlx_relay.engine.models.qwen3_5.kernels.gated_delta_cpu import chunkwise, recurrence

        mx.random.seed(T)
        B, Hk, Hv, Dk, Dv = 2, 2, 4, 16, 8
        q = mx.random.normal((B, T, Hk, Dk)) / 4
        k = mx.random.normal((B, T, Hk, Dk)) / 4
        v = mx.random.normal((B, T, Hv, Dv))
        g = mx.random.uniform(0.7, 1.0, (B, T, Hv))
        g = mx.where(mx.arange(T)[None, :, None] % 11 == 5, 0.0, g)  # some gates underflowed to 0
        beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
        state = mx.random.normal((B, Hv, Dv, Dk))
        mask = (mx.arange(T)[None, :] < mx.array([[T], [max(1, T - 9)]])) if masked else None
        want_y, want_s = gated_delta_ops(q, k, v, g, beta, state, mask)
        y, s = recurrence(q, k, v, g, beta, state, mask)
        y2, s2 = chunkwise(q, k, v, g, beta, state, mask, block=8)  # the chunkwise form at any length
        keep = mx.ones((B, T, 1, 1), dtype=mx.bool_) if mask is None else mask[..., None, None]

        def rel(a: mx.array, b: mx.array) -> float:
            return float((mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1.0)).item())

        return (rel(mx.where(keep, y, 0), mx.where(keep, want_y, 0)), rel(s, want_s),
                max(rel(mx.where(keep, y2, 0), mx.where(keep, want_y, 0)), rel(s2, want_s)))

    y_rel, s_rel, block_rel = gpu(run)
    assert y_rel < TOL and s_rel < TOL and block_rel < TOL, (y_rel, s_rel, block_rel)

"""The experts over few (token, expert) pairs, one product a pair (`kernels/pair_qmv.py`, the CUDA
GPU's path for the decode step, the MTP round and small slices): its plain-MLX product, through
`pair_switch_glu`, equals the library's 8-bit `SwitchGLU` in float32 (the gate and up projections
over each token's row, the down projection over each pair's, the output [..., k, H]); the kernel's
own arithmetic is pinned on the GPU against a float32 truth (`benchmarks/gpu/kernel_check.py`).
Off a CUDA GPU the path is never taken."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

E, K_TOP, H, INNER = 16, 4, 512, 1024


def _switch(bits: int, group_size: int = 64) -> Any:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.switch_layers import SwitchGLU

    mx.random.seed(3)
    switch = SwitchGLU(H, INNER, E)
    nn.quantize(switch, group_size=group_size, bits=bits)
    return switch


@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (1, 3), (2, 5)], ids=["one row", "4 rows", "a block", "2x5"])
def test_the_pair_product_is_the_librarys_switch_glu(gpu: Callable, shape: tuple[int, int]) -> None:
    def run() -> bool:
        import mlx.core as mx

        from mlx_relay.engine.models.qwen3_5.kernels.pair_qmv import pair_switch_glu, reference_pair_qmv

        switch = _switch(8)
        mx.random.seed(4)
        x = mx.random.normal((*shape, H))
        inds = mx.argpartition(mx.random.normal((*shape, E)), kth=-K_TOP, axis=-1)[..., -K_TOP:].astype(mx.uint32)
        ours, ref = pair_switch_glu(switch, x, inds, project=reference_pair_qmv), switch(x, inds)
        mx.eval(ours, ref)
        return ours.shape == ref.shape == (*shape, K_TOP, H) and bool(mx.allclose(ours, ref, atol=2e-5, rtol=2e-5))

    assert gpu(run)


def test_the_kernel_takes_only_its_shapes_and_never_off_cuda(gpu: Callable) -> None:
    def run() -> list[bool]:
        import mlx.core as mx
        from mlx.utils import tree_map

        from mlx_relay.engine.models.qwen3_5.kernels.pair_qmv import MAX_PAIRS, fits, use_pairs

        x16 = mx.zeros((1, 1, H), dtype=mx.bfloat16)
        eight = _switch(8)
        eight.update(tree_map(lambda v: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v, eight.parameters()))
        return [fits(eight, x16), fits(eight, x16.astype(mx.float32)), fits(_switch(4), x16),
                fits(_switch(8, group_size=32), x16), use_pairs(eight, x16, 8), use_pairs(eight, x16, MAX_PAIRS + 1)]

    # an 8-bit switch of groups of 64 over bf16 rows fits; float32 rows, 4 bits, groups of 32 do not;
    # this CPU never runs it
    assert gpu(run) == [True, False, False, False, False, False]

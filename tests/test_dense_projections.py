"""The family's dense projections (`models/qwen3_5/kernels/dense.py`): the layer loop calls each
`nn.QuantizedLinear` through `dense` and each of the library's gated MLPs through `mlp`. Off a CUDA
GPU (every run here) both are the library's own arithmetic, op for op; on a GPU, few rows of an
8-bit projection run our kernel (`benchmarks/gpu/kernel_check.py` pins it against a float32 truth).
What this pins: `mlp` is the library's MLP call exactly (the MoE's shared expert, float32), `dense`
is the module's call here, and `fits` admits only what the kernel was written for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.test_moe_decode import build_moe_lm


def test_mlp_is_the_library_call_and_dense_the_module_call_off_a_gpu(gpu: Callable) -> None:
    def run() -> None:
        import mlx.core as mx
        import mlx.nn as nn

        from mlx_relay.engine.models.qwen3_5.kernels.dense import dense, mlp

        lm = build_moe_lm(5)
        block = lm.model.layers[0].mlp
        for rows in (1, 8, 12):
            x = mx.random.normal((1, rows, 64))
            assert mx.array_equal(mlp(block.shared_expert, x), block.shared_expert(x)).item()
            assert mx.array_equal(dense(block.gate, x), block.gate(x)).item()
        q = nn.QuantizedLinear.from_linear(nn.Linear(256, 64, bias=False), group_size=64, bits=8)
        x = mx.random.normal((8, 256))
        assert mx.array_equal(dense(q, x), q(x)).item()
        other = nn.Sequential(nn.Linear(64, 64))
        assert mx.array_equal(mlp(other, mx.ones((2, 64))), other(mx.ones((2, 64)))).item()

    gpu(run)


def test_fits_admits_only_the_kernels_projections(gpu: Callable) -> None:
    def run() -> dict[str, bool]:
        import mlx.core as mx
        import mlx.nn as nn

        from mlx_relay.engine.models.qwen3_5.kernels.dense import fits

        def q(n: int, k: int, bits: int = 8, group: int = 64, bias: bool = False) -> Any:
            lin = nn.QuantizedLinear.from_linear(nn.Linear(k, n, bias=bias), group_size=group, bits=bits)
            lin.update({"scales": lin.scales.astype(mx.bfloat16), "biases": lin.biases.astype(mx.bfloat16)})
            return lin

        x256, x128 = mx.zeros((8, 256), dtype=mx.bfloat16), mx.zeros((8, 128), dtype=mx.bfloat16)
        return {"8-bit": fits(q(64, 256), x256), "4-bit": fits(q(64, 256, bits=4), x256),
                "group 32": fits(q(64, 256, group=32), x256), "bias": fits(q(64, 256, bias=True), x256),
                "K 128": fits(q(64, 128), x128), "N 8": fits(q(8, 256), x256),
                "float32 rows": fits(q(64, 256), x256.astype(mx.float32)),
                "float": fits(nn.Linear(256, 64, bias=False), x256)}

    assert gpu(run) == {"8-bit": True, "4-bit": False, "group 32": False, "bias": False, "K 128": False,
                        "N 8": False, "float32 rows": False, "float": False}

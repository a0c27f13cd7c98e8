"""The family's dense projections (`models/qwen3_5/kernels/dense.py`): the layer loop calls each
`nn.QuantizedLinear` through `dense` and each of the library's gated MLPs through `mlp`. Off a CUDA
GPU (every run here) both are the library's own arithmetic, op for op; on a GPU, `dense.path` picks
our kernel for few rows, a dequantized 16-bit matmul for many (`benchmarks/gpu/kernel_check.py` pins
the kernel against a float32 truth). What this pins: `mlp` is the library's MLP call exactly (the
MoE's shared expert, float32), `dense` is the module's call here, the dequantized product is the
library's (float32), `path` follows the measured table, and `fits` admits only what the kernel was
written for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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


def test_the_dequantized_product_is_the_library_s_in_float32(gpu: Callable) -> None:
    def run() -> float:
        import mlx.core as mx
        import mlx.nn as nn

        from mlx_relay.engine.models.qwen3_5.kernels.dense import dequantized

        worst = 0.0
        for bias in (False, True):
            q = nn.QuantizedLinear.from_linear(nn.Linear(256, 96, bias=bias), group_size=64, bits=8)
            for rows in (8, 40, 300):
                x = mx.random.normal((1, rows, 256))
                worst = max(worst, mx.abs(dequantized(q, x) - q(x)).max().item())
        return worst

    assert gpu(run) < 1e-4


def test_path_follows_the_measured_table(gpu: Callable) -> None:
    """Which arithmetic a CUDA GPU runs per projection and row count (`dense.path`; the module
    docstring gives the device times behind each choice)."""
    def run() -> dict[str, str]:
        import mlx.core as mx
        import mlx.nn as nn

        from mlx_relay.engine.models.qwen3_5.kernels.dense import path

        def q(n: int, k: int, bits: int = 8) -> Any:
            lin = nn.QuantizedLinear(k, n, bias=False, group_size=64, bits=bits)
            lin.update({"scales": lin.scales.astype(mx.bfloat16), "biases": lin.biases.astype(mx.bfloat16)})
            return lin

        head = q(64, 2048)
        head.update({"weight": mx.zeros((40_000, 512), dtype=mx.uint32)})  # 40,000 x 2,048: only its shape is read
        shapes = {"8192x2048": q(8192, 2048), "4096x2048": q(4096, 2048), "2048x512": q(2048, 512),
                  "256x2048": q(256, 2048), "1x2048": q(1, 2048), "4-bit": q(4096, 2048, bits=4), "head": head}
        out = {}
        for name, m in shapes.items():
            K = 2048 if name != "2048x512" else 512
            for rows in (1, 8, 24, 64, 264):
                out[f"{name} {rows}"] = path(m, mx.zeros((1, rows, K), dtype=mx.bfloat16))
        out["float 264"] = path(nn.Linear(64, 64), mx.zeros((264, 64), dtype=mx.bfloat16))
        return out

    got = gpu(run)
    expect = {}
    for name in ("8192x2048", "4096x2048", "2048x512", "256x2048", "head"):
        expect |= {f"{name} 1": "library", f"{name} 8": "narrow", f"{name} 24": "narrow"}
    expect |= {"8192x2048 64": "library", "8192x2048 264": "dequantize", "head 64": "library", "head 264": "library"}
    for name in ("4096x2048", "2048x512", "256x2048", "1x2048"):
        expect |= {f"{name} 64": "dequantize", f"{name} 264": "dequantize"}
    expect |= {"1x2048 1": "library", "1x2048 8": "library", "1x2048 24": "library"}  # no whole tile: N 1
    expect |= {f"4-bit {r}": "library" for r in (1, 8, 24, 64, 264)} | {"float 264": "library"}
    assert got == expect


def test_the_family_calls_no_projection_directly() -> None:
    """The module docstring's sentence, checked: the Qwen3.5 family's forwards (the decode step,
    the prefill chunk, the mixed step, the compiled parts) call every projection through `dense`,
    `dense_many` or `mlp`, never the module itself (a chunk's output projections once ran as the
    library's call at any rows: MLX's quantized matmul where `dense` runs ours or a dequantized one)."""
    import re

    import mlx_relay.engine.models.qwen3_5 as family

    root = Path(family.__file__).parent
    direct = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in sorted(root.rglob("*.py"))
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"\.\w*proj\w*\(", line) and not line.lstrip().startswith("#")]
    assert direct == []

"""A prefill chunk through the family's block forward over explicit caches (`forward_block` with
the prefill's options: the decode step's machinery, compiled or not) equals the chunk through our
prefill forward over the library's caches (`benchmarks/prefill_block.py`, issue 43.3: the lever for
a step that carries a prefill slice beside decoding rows is only worth timing if it is the same
arithmetic). Float32, the dense fixture and the mixture of experts, at chunks of 1 to 16 tokens
after 16 and 40 tokens of context, eager and compiled."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.testing.scripts import load_script
from tests.test_moe_decode import build_moe_lm

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_the_block_forward_is_the_prefill_forward(gpu: Callable, fp32_model: Path, model: str) -> None:
    bench = load_script(REPO / "benchmarks" / "prefill_block.py", "prefill_block_bench")

    def run() -> dict[tuple[int, int, bool], float]:
        import mlx.core as mx

        from mlx_relay.engine.models.loader import load_model

        lm: Any = load_model(fp32_model).model.language_model if model == "dense" else build_moe_lm(3)
        out = {}
        for context in (16, 40):
            caches = bench.context_caches(lm, context, 16, 0)
            for chunk in (1, 5, 16):
                for compiled in (False, True):
                    mx.random.seed(chunk)
                    out[(context, chunk, compiled)] = bench.check(lm, caches, context, chunk, compiled=compiled)
        return out

    rel = gpu(run)
    assert max(rel.values()) <= 1e-5, rel

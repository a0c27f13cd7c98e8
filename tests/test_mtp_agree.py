"""The value construction behind ``build_random_model.py --mtp-agree RATE`` (benchmarks/gpu/mtp_agree.py,
issue 17.5), at a small vocabulary: the cycle, the block-2 acceptance of its agreement pattern from every
entry point, and the bigram and the head's agreement surviving 8-bit g64 quantization. (The whole build
and bench_mtp on the `--tiny` model are in benchmarks/gpu/README.md; they take minutes on a CPU.)"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

from mlx_relay.testing.scripts import load_script

_SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu" / "mtp_agree.py"


def _load() -> ModuleType:
    return load_script(_SCRIPT, "mtp_agree")


@pytest.mark.parametrize("rate", [0.6, 0.75, 0.8, 1.0, 0.33])
def test_the_pattern_gives_the_rate_from_every_entry_point(rate: float) -> None:
    ma = _load()
    plan = ma.make_plan(rate, 10_000, seed=3)
    assert abs(plan.design_rate - rate) <= 0.02
    # one long cycle over distinct regular ids, a whole number of periods
    assert len(np.unique(plan.order)) == len(plan.order) > 10_000 - plan.period
    assert plan.order.max() < 10_000 and len(plan.order) % plan.period == 0
    agrees = plan.agrees()
    assert abs(agrees.mean() - 2 * plan.a / plan.period) < 1e-9
    window = np.tile(agrees[: plan.period], 60)
    for start in range(plan.period):  # wherever the chain enters the cycle
        acc, rounds = ma.block2_acceptance(window, start=start, skip=2 * (plan.a + plan.b))
        assert abs(acc / rounds - plan.design_rate) <= (plan.a + plan.b) / rounds  # a cut last period


def test_bigram_and_head_agreement_survive_8bit_quantization() -> None:
    ma = _load()
    vocab, hidden = 1600, 256
    plan = ma.make_plan(0.75, 1500, seed=1)
    mx.random.seed(1)
    embed, head = ma.embed_and_head(plan, vocab, hidden, mx.bfloat16)
    embed, head = (np.array(mx.dequantize(*mx.quantize(w, 64, 8), group_size=64, bits=8).astype(mx.float32))
                   for w in (embed, head))

    def rms_norm(v: np.ndarray) -> np.ndarray:
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-6)

    x = rms_norm(embed[plan.order])
    assert (np.argmax(x @ head.T, axis=-1) == plan.successors()).all()  # the target's bigram is the cycle
    fc = np.array(ma.fc_value(hidden, mx.float32))
    h = rms_norm(np.concatenate([x, np.zeros_like(x)], axis=-1) @ fc.T)
    drafted = np.argmax(h @ head.T, axis=-1)  # the head: the cycle where planned, another token elsewhere
    assert ((drafted == plan.successors()) == plan.agrees()).all()

"""The mixture-of-experts layers of the Qwen3.5 family (issue 32): our decode step routes and
combines the experts through `kernels.moe` (its fallback on this CPU: the library's router and
combine, op for op), so on a float32 qwen3_5_moe language model it returns the greedy tokens and
logits of mlx-vlm's own decode through its caches, for a lone row and for a batch of two. The
GatedDeltaNet mixer's fallback (`kernels.gated_delta`) is pinned the same way by
`tests/test_decode_step.py` and `tests/test_mtp_step.py`; `benchmarks/gpu/kernel_check.py` pins
the CUDA kernels against these fallbacks on a GPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.test_decode_step import _positions, _prefill

CONFIG = {
    "model_type": "qwen3_5_moe_text", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "rms_norm_eps": 1e-6, "vocab_size": 512, "max_position_embeddings": 4096, "full_attention_interval": 4,
    "tie_word_embeddings": False, "attention_bias": False, "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}
PROMPTS = [list(range(10, 50)), list(range(60, 75))]
STEPS = 10


def build_moe_lm(seed: int) -> Any:
    """A float32 qwen3_5_moe language model of `CONFIG`, random weights drawn from `seed` (on the
    GPU thread)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_vlm.models.qwen3_5_moe.config import TextConfig
    from mlx_vlm.models.qwen3_5_moe.language import LanguageModel

    mx.random.seed(seed)
    model = LanguageModel(TextConfig.from_dict(CONFIG))
    # weights with some spread (the default init leaves the router's probabilities near-uniform)
    params = [(k, mx.random.normal(v.shape) * (0.02 if v.ndim > 1 else 0.1) + (1.0 if "norm" in k else 0.0))
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    model.apply(lambda x: x.astype(mx.float32))
    assert isinstance(model.model.layers[0].mlp.gate, nn.Linear)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def lm(gpu: Callable) -> Any:
    return gpu(lambda: build_moe_lm(3))


def _library(lm: Any, prompt: list[int], n: int) -> tuple[list[int], list[Any]]:
    """mlx-vlm's greedy decode through its own caches: tokens and each step's logits."""
    import mlx.core as mx

    cache, token = _prefill(lm, prompt)
    tokens, logits = [], []
    for i in range(n):
        tokens.append(int(token.item()))
        at = len(prompt) + i
        out = lm(token[:, None], cache=cache, position_ids=_positions(at, at + 1)).logits[:, -1, :]
        logits.append(out[0])
        token = mx.argmax(out, axis=-1).astype(mx.int32)
    return tokens, logits


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_moe_rows_decode_exactly_as_the_library(gpu: Callable, lm: Any, compiled: bool) -> None:
    import mlx.core as mx

    from mlx_relay.engine.lanes import decode_state
    from mlx_relay.engine.lanes.decode_state import DecodeState
    from mlx_relay.engine.lanes.decode_step import DecodeStep
    from mlx_relay.engine.memory.batch_caches import as_batch_caches

    def run() -> tuple[list[list[int]], list[tuple[list[int], list[Any]]], float]:
        step = DecodeStep(lm, compiled=compiled)
        state, tokens = None, []
        for prompt in PROMPTS:
            cache, first = _prefill(lm, prompt)
            s = DecodeState.from_batch_caches(as_batch_caches(cache), [0])
            state = s if state is None else (state.extend(s) or state)
            tokens.append(first)
        assert state is not None
        state.pad_to(decode_state.batch_bucket(len(PROMPTS)))
        token = mx.concatenate(tokens)
        refs = [_library(lm, p, STEPS) for p in PROMPTS]
        ours: list[list[int]] = [[] for _ in PROMPTS]
        worst = 0.0
        for t in range(STEPS):
            fed = token.tolist()
            logits = step(token, state)
            for r in range(len(PROMPTS)):
                ours[r].append(fed[r])
                worst = max(worst, float(mx.abs(logits[r] - refs[r][1][t]).max()))
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
        return ours, refs, worst

    ours, refs, worst = gpu(run)
    assert worst < 1e-4
    assert ours == [r[0] for r in refs]
    assert len(set(ours[0])) > 1  # the rows do not sit on one token


def test_the_fallback_router_is_the_librarys(gpu: Callable, lm: Any) -> None:
    """`route_topk` + `combine` (fallback) over a layer's input give the library block's output exactly."""
    import mlx.core as mx

    from mlx_relay.engine.models.qwen3_5.kernels.moe import fallback_combine, fallback_route_topk

    def run() -> float:
        mlp = lm.model.layers[0].mlp
        x = mx.random.normal((2, 3, CONFIG["hidden_size"]))
        h = mx.random.normal(x.shape)
        inds, scores = fallback_route_topk(mlp.gate(x), mlp.top_k, mlp.norm_topk_prob)
        ours = fallback_combine(h, mlp.switch_mlp(x, inds), scores, mlp.shared_expert_gate(x), mlp.shared_expert(x))
        return float(mx.abs(ours - (h + mlp(x))).max())

    assert gpu(run) == 0.0

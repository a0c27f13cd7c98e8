"""Pins what SpecPrefill's draft scorer relies on in mlx_lm and mlx_vlm
(:mod:`mlx_relay.engine.scoring.draft_library`), on CPU: which library loads which draft, both
libraries' KV caches as the adapter reads them, RoPE at the cache's positions, and -- the
reason a qwen3_5 draft goes through mlx_vlm -- that mlx_vlm's GatedDeltaNet update takes the
chunked scan for a prefill when no Metal kernel runs, where mlx_lm's takes the per-token loop."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as lm_gd
from mlx_lm.models.cache import ArraysCache as LmArraysCache
from mlx_lm.models.cache import KVCache as LmKVCache
from mlx_lm.models.cache import RotatingKVCache
from mlx_vlm.models.cache import ArraysCache as VlmArraysCache
from mlx_vlm.models.cache import KVCache as VlmKVCache
from mlx_vlm.models.qwen3_5 import gated_delta as vlm_gd

from mlx_relay.engine.scoring.draft_library import (
    LoadedDraft,
    cache_arrays,
    cached_keys_values,
    draft_library,
    is_attention_cache,
    load_draft,
    make_cache,
    read_config,
    rotate_queries,
)


@pytest.fixture(scope="module")
def drafts(fp32_model: Path) -> dict[str, LoadedDraft]:
    """The suite's float32 hybrid fixture, loaded through each library."""
    return {library: load_draft(fp32_model, library) for library in ("mlx-lm", "mlx-vlm")}


def test_qwen3_5_family_drafts_go_to_mlx_vlm(fp32_model: Path) -> None:
    assert draft_library(read_config(fp32_model)) == "mlx-vlm"  # the VLM fixture: model_type qwen3_5
    for model_type in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"):
        assert draft_library({"model_type": model_type}) == "mlx-vlm"
        assert draft_library({"model_type": "some_vlm", "text_config": {"model_type": model_type}}) == "mlx-vlm"
    for config in ({"model_type": "qwen3"}, {"model_type": "llama"}, {"model_type": "qwen3_next"}, {}):
        assert draft_library(config) == "mlx-lm"
    assert read_config(fp32_model / "nowhere") == {}


def test_what_each_library_loads(drafts: dict[str, LoadedDraft]) -> None:
    lm, vlm = drafts["mlx-lm"], drafts["mlx-vlm"]
    assert (lm.library, vlm.library) == ("mlx-lm", "mlx-vlm")
    assert lm.model_type == vlm.model_type == "qwen3_5"
    assert type(vlm.model).__module__ == "mlx_vlm.models.qwen3_5.language"  # the text model alone
    assert getattr(vlm.model, "vision_tower", None) is None
    for draft in (lm, vlm):
        kinds = [is_attention_cache(c) for c in make_cache(draft.model)]
        assert kinds == [False, False, False, True]  # 3 GatedDeltaNet layers, then attention
        assert len(draft.model.layers) == 4 and isinstance(draft.model.model.layers, list)
    assert [type(c) for c in make_cache(vlm.model)] == [VlmArraysCache] * 3 + [VlmKVCache]
    assert [type(c) for c in make_cache(lm.model)] == [LmArraysCache] * 3 + [LmKVCache]


@pytest.mark.parametrize("cache_type", [LmKVCache, VlmKVCache])
def test_kv_cache_state_as_the_adapter_reads_it(cache_type: type) -> None:
    """mlx_lm's ``state``: (keys, values, offset), the whole preallocated buffer; mlx_vlm's:
    (keys, values) trimmed to ``offset``. Either way the adapter gives every key so far."""
    cache = cache_type()
    first = mx.random.normal((1, 2, 5, 8), key=mx.random.key(0))
    second = mx.random.normal((1, 2, 3, 8), key=mx.random.key(1))
    cache.update_and_fetch(first, first * 2)
    cache.update_and_fetch(second, second * 2)
    assert cache.offset == 8 and isinstance(cache.offset, int)
    state = cache.state
    if cache_type is LmKVCache:
        assert len(state) == 3 and state[2] == 8 and state[0].shape[2] >= 8
    else:
        assert len(state) == 2 and state[0].shape[2] == 8
    keys, values, offset = cached_keys_values(cache)
    assert offset == 8
    expected = mx.concatenate([first, second], axis=2)
    np.testing.assert_array_equal(np.array(keys), np.array(expected))
    np.testing.assert_array_equal(np.array(values), np.array(expected * 2))
    assert all(isinstance(a, mx.array) for a in cache_arrays([cache]))
    assert is_attention_cache(cache)
    assert not is_attention_cache(RotatingKVCache(max_size=8))
    assert not is_attention_cache(LmArraysCache(2)) and not is_attention_cache(VlmArraysCache(2))


@pytest.mark.parametrize("library", ["mlx-lm", "mlx-vlm"])
def test_queries_rotate_as_the_module_rotates_its_cached_keys(library: str, drafts: dict[str, LoadedDraft]) -> None:
    """The attention module called without positions rotates at the cache's offset (mlx_vlm's
    qwen3_5: multimodal RoPE, every axis the text position): ``rotate_queries`` applied to the
    normed keys gives back the keys the module stored, for a second call at offset 6."""
    model = drafts[library].model
    attn = model.layers[3].self_attn
    cache = make_cache(model)[3]
    x = mx.random.normal((1, 10, model.layers[3].input_layernorm.weight.shape[0]), key=mx.random.key(2))
    attn(x[:, :6], mask="causal", cache=cache)
    attn(x[:, 6:], mask="causal", cache=cache)
    keys, _, offset = cached_keys_values(cache)
    assert offset == 10
    n_kv = keys.shape[1]
    raw = attn.k_norm(attn.k_proj(x[:, 6:]).reshape(1, 4, n_kv, -1)).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.array(rotate_queries(attn, raw, 6)), np.array(keys[..., 6:, :]), atol=1e-5, rtol=1e-5)


def _gdn_inputs(T: int) -> tuple[mx.array, ...]:
    """GatedDeltaNet inputs: q, k (normalized as the layers do), v, a, b, A_log, dt_bias, state."""
    B, Hk, Hv, Dk, Dv = 1, 2, 4, 16, 8
    keys = iter(mx.random.split(mx.random.key(7), 8))
    q = mx.random.normal((B, T, Hk, Dk), key=next(keys))
    k = mx.random.normal((B, T, Hk, Dk), key=next(keys))
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5  # as the layers normalize them
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv), key=next(keys))
    a = mx.random.normal((B, T, Hv), key=next(keys))
    b = mx.random.normal((B, T, Hv), key=next(keys))
    A_log = mx.log(mx.random.uniform(0.01, 1.0, (Hv,), key=next(keys)))
    dt_bias = mx.random.normal((Hv,), key=next(keys))
    state = mx.random.normal((B, Hv, Dv, Dk), key=next(keys)) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


def test_mlx_vlm_prefills_gated_delta_with_the_chunked_scan_off_metal() -> None:
    """What makes the hybrid draft fast on CUDA, pinned on CPU (no Metal kernel either): for
    T > 1, mlx_vlm's ``gated_delta_update`` -- also through a fresh ``ArraysCache``, as its
    GatedDeltaNet layer calls it -- returns exactly ``gated_delta_chunked``'s output, while
    mlx_lm's returns exactly its per-token ``gated_delta_ops`` loop's; the two agree."""
    assert not mx.metal.is_available()
    T = 70  # two chunks of 64, the second padded
    q, k, v, a, b, A_log, dt_bias, state = _gdn_inputs(T)
    g = vlm_gd.compute_g(A_log, a, dt_bias)
    beta = mx.sigmoid(b)
    chunked_y, chunked_state = vlm_gd.gated_delta_chunked(q, k, v, g, beta, state)

    y, new_state = vlm_gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, use_kernel=False)
    np.testing.assert_array_equal(np.array(y), np.array(chunked_y))
    np.testing.assert_array_equal(np.array(new_state), np.array(chunked_state))
    y, _ = vlm_gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, use_kernel=True)  # no Metal here
    np.testing.assert_array_equal(np.array(y), np.array(chunked_y))

    cache = VlmArraysCache(size=2)
    assert cache.history_capacity == 0  # not speculating: no per-step states are recorded
    cache[1] = state
    y, _ = vlm_gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, cache=cache, cache_index=1)
    np.testing.assert_array_equal(np.array(y), np.array(chunked_y))
    np.testing.assert_array_equal(np.array(cache[1]), np.array(chunked_state))

    lm_y, lm_state = lm_gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    ops_y, ops_state = lm_gd.gated_delta_ops(q, k, v, lm_gd.compute_g(A_log, a, dt_bias), beta, state)
    np.testing.assert_array_equal(np.array(lm_y), np.array(ops_y))
    np.testing.assert_array_equal(np.array(lm_state), np.array(ops_state))

    # two computations (the pins above tell them apart), one recurrence
    assert not np.array_equal(np.array(chunked_y), np.array(ops_y))
    np.testing.assert_allclose(np.array(chunked_y), np.array(ops_y), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(chunked_state), np.array(ops_state), rtol=1e-4, atol=1e-5)

"""SpecPrefill's draft scorer on real tiny models (CPU): the query reconstruction pinned against
each supported attention module (mlx_lm's and mlx_vlm's), scores against an independent float64
reference, the hybrid draft's scores the same through mlx_vlm (chunked GatedDeltaNet scan) as
through mlx_lm (per-token loop), chunking invariance, and the refusals (another vocabulary,
attention the probes cannot rebuild, a draft whose activations are not finite)."""

from __future__ import annotations

import importlib
import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_vlm.models.cache import KVCache as VlmKVCache
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import AutoTokenizer

from mlx_relay.engine.scoring.draft_library import load_draft
from mlx_relay.engine.scoring.draft_scorer import (
    DraftIncompatible,
    DraftScorer,
    QueryProbe,
    ScoringFailed,
    chunk_bounds,
    project_queries,
    query_layout,
)
from mlx_relay.errors import GenerationFailed, ModelLoadError
from mlx_relay.specprefill.selection import select_chunks
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
VOCAB = 1026
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "max_position_embeddings": 4096,
    },
    "qwen3": {
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "max_position_embeddings": 4096,
    },
    # a sliding-window layer (RotatingKVCache: its keys do not cover the prompt) is left out
    "llama_sliding": {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    },
    # fused qkv_proj: no q_proj to rebuild the queries from
    "phi3": {
        "model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
    },
    # llama-like attribute names, but its logits are soft-capped: the probes cannot rebuild it
    "gemma2": {
        "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "attn_logit_softcapping": 0.5, "query_pre_attn_scalar": 16,
    },
}
TEXT = "def score(tokens): return [attention(q, k) for q, k in zip(queries, keys)]  # SpecPrefill " * 6


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def draft_path() -> Path:
    """The draft: a tiny fp32 Qwen3.5 VLM checkpoint (hybrid: 3 GatedDeltaNet + 1 attention)."""
    return fixture_path(FixtureSpec(variant="fp32", seed=1))


@pytest.fixture(scope="module")
def target_tokenizer(fp32_model: Path) -> Any:
    """The target's tokenizer (another model of the same recipe: the same vocabulary)."""
    return AutoTokenizer.from_pretrained(str(fp32_model))


@pytest.fixture(scope="module")
def tokens(target_tokenizer: Any) -> list[int]:
    ids = list(target_tokenizer.encode(TEXT))
    assert 150 <= len(ids) <= 600
    return ids


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory, draft_path: Path) -> dict[str, Path]:
    """Text checkpoints of mlx_lm's own llama / qwen3 / gemma2 classes (random weights, the
    fixture's tokenizer), written to disk so that DraftScorer.load reads them like any draft."""
    root = tmp_path_factory.mktemp("drafts")
    paths: dict[str, Path] = {}
    for seed, (name, config) in enumerate(TINY_CONFIGS.items()):
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        mx.random.seed(100 + seed)
        model = module.Model(module.ModelArgs.from_dict(config))
        out = root / name
        out.mkdir()
        model.save_weights(str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config))
        _copy_tokenizer(draft_path, out)
        paths[name] = out
    return paths


@pytest.fixture(scope="module")
def draft_paths(draft_path: Path, tiny_checkpoints: dict[str, Path]) -> dict[str, Path]:
    return {"qwen3_5": draft_path, "qwen3": tiny_checkpoints["qwen3"], "llama": tiny_checkpoints["llama"]}


@pytest.fixture(scope="module")
def scorers(draft_paths: dict[str, Path], target_tokenizer: Any) -> dict[str, DraftScorer]:
    """Each draft as served (the hybrid qwen3_5 one through mlx_vlm), and ``qwen3_5_lm``: the
    same hybrid checkpoint through mlx_lm, the path it took before."""
    loaded = {name: DraftScorer.load(path, target_tokenizer) for name, path in draft_paths.items()}
    loaded["qwen3_5_lm"] = DraftScorer.load(draft_paths["qwen3_5"], target_tokenizer, library="mlx-lm")
    return loaded


def _run(scorer: DraftScorer, tokens: list[int], *, chunk: int, window: int) -> tuple[list[float], int]:
    """Scores and the number of steps they took."""
    job = scorer.start(tokens, chunk=chunk, window=window)
    steps = 0
    while True:
        steps += 1
        scores = job.step()
        if scores is not None:
            assert job.finished
            return scores, steps
        assert not job.finished


# --------------------------------------------------------------------------- 1. the adapter pin


def _reference_attention(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    """float64 softmax(q k^T * scale) with grouped kv heads, the queries at the last positions."""
    _, H, W, _ = q.shape
    n_kv, N = k.shape[1], k.shape[2]
    kv_of = np.arange(H) // (H // n_kv)
    logits = np.einsum("bhwd,bhnd->bhwn", q, k[:, kv_of]) * scale
    visible = np.arange(N)[None, :] <= np.arange(N - W, N)[:, None]
    logits = np.where(visible, logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    return probs / probs.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_vlm", "qwen3", "llama"])
def test_reconstructed_queries_and_cached_keys_reproduce_the_attention(arch: str, draft_paths: dict[str, Path]) -> None:
    """Pins what the probes rely on in mlx_lm and mlx_vlm (``qwen3_5_vlm``: the hybrid draft's
    gated attention as mlx_vlm builds it, multimodal RoPE): the queries rebuilt from the
    attention input and the post-RoPE keys/values of the layer's KVCache give back the module's
    own output (second chunk, so RoPE offsets and keys from an earlier call are covered)."""
    vlm = arch == "qwen3_5_vlm"
    if vlm:
        model = load_draft(draft_paths["qwen3_5"], "mlx-vlm").model
        index = next(i for i, c in enumerate(model.make_cache()) if type(c) is VlmKVCache)
    else:
        model, _ = mlx_lm.load(str(draft_paths[arch]))
        index = next(i for i, c in enumerate(make_prompt_cache(model)) if type(c) is KVCache)
    attn = model.layers[index].self_attn
    layout = query_layout(attn)
    assert layout.gated == arch.startswith("qwen3_5")

    x = mx.random.normal((1, 13, model.layers[index].input_layernorm.weight.shape[0]), key=mx.random.key(3))
    first, second = x[:, :6], x[:, 6:]
    cache = VlmKVCache() if vlm else KVCache()
    attn(first, mask=create_attention_mask(first, cache), cache=cache)
    expected = attn(second, mask=create_attention_mask(second, cache), cache=cache)

    queries, gate = project_queries(attn, layout, second, offset=6)
    offset = cache.offset
    keys, values = cache.state[:2]
    assert offset == 13
    k = np.array(keys[..., :offset, :], dtype=np.float64)
    v = np.array(values[..., :offset, :], dtype=np.float64)
    probs = _reference_attention(np.array(queries, dtype=np.float64), k, float(attn.scale))
    H = probs.shape[1]
    mixed = np.einsum("bhwn,bhnd->bwhd", probs, v[:, np.arange(H) // (H // k.shape[1])]).reshape(1, 7, -1)
    if gate is not None:
        mixed = mixed / (1.0 + np.exp(-np.array(gate, dtype=np.float64)))
    rebuilt = attn.o_proj(mx.array(mixed.astype(np.float32)))
    np.testing.assert_allclose(np.array(rebuilt), np.array(expected), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- 2. outputs unchanged


def _logits(output: Any) -> np.ndarray:
    """mlx_lm's models return the logits, mlx_vlm's language models an output holding them."""
    return np.array(getattr(output, "logits", output))


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_lm"])
def test_wrapping_leaves_the_logits_bit_identical(
    name: str, draft_path: Path, scorers: dict[str, DraftScorer], tokens: list[int]
) -> None:
    scorer = scorers[name]
    library = "mlx-lm" if name == "qwen3_5_lm" else "mlx-vlm"
    assert scorer.info.library == library
    plain = load_draft(draft_path, library).model
    assert scorer.info.attention_layers == 1
    assert isinstance(scorer.model.layers[3].self_attn, QueryProbe)
    inputs = mx.array([tokens[:64]])
    before = _logits(plain(inputs))
    np.testing.assert_array_equal(_logits(scorer.model(inputs)), before)
    _run(scorer, tokens, chunk=40, window=8)  # a scoring job in between changes nothing either
    np.testing.assert_array_equal(_logits(scorer.model(inputs)), before)
    cache = make_prompt_cache(scorer.model)
    np.testing.assert_array_equal(_logits(scorer.model(inputs, cache=cache)), before)


# --------------------------------------------------------------------------- 3. the scores


def test_chunk_bounds_cover_the_prompt_and_end_with_the_window() -> None:
    for n in (1, 2, 15, 16, 17, 100, 101, 257):
        for chunk in (1, 4, 16, 37, 10_000):
            for window in (1, 16, 64):
                bounds = chunk_bounds(n, chunk, window)
                assert bounds[0][0] == 0 and bounds[-1][1] == n
                assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(bounds))
                assert all(b - a <= chunk for a, b in bounds[:-1])
                assert bounds[-1][1] - bounds[-1][0] >= min(window, n)
                assert bounds[-1][1] - bounds[-1][0] <= max(chunk, min(window, n))
    assert chunk_bounds(0, 8, 8) == []
    assert chunk_bounds(100, 30, 16) == [(0, 30), (30, 60), (60, 84), (84, 100)]
    assert chunk_bounds(95, 30, 16) == [(0, 30), (30, 60), (60, 79), (79, 95)]
    with pytest.raises(ValueError):
        chunk_bounds(10, 0, 4)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_lm", "qwen3", "llama"])
def test_scores_are_one_finite_nonnegative_value_per_token_whatever_the_chunking(
    arch: str, scorers: dict[str, DraftScorer], tokens: list[int]
) -> None:
    scorer = scorers[arch]
    whole, steps = _run(scorer, tokens, chunk=10_000, window=16)
    assert steps == 1
    assert len(whole) == len(tokens)
    assert all(np.isfinite(whole)) and min(whole) >= 0.0
    chunked, steps = _run(scorer, tokens, chunk=37, window=16)
    assert steps == len(chunk_bounds(len(tokens), 37, 16)) > 1
    np.testing.assert_allclose(chunked, whole, rtol=1e-4, atol=1e-7)
    # a chunk smaller than the window: the last chunk still holds the whole window
    small, _ = _run(scorer, tokens, chunk=5, window=16)
    np.testing.assert_allclose(small, whole, rtol=1e-4, atol=1e-7)


class _Recorder(nn.Module):
    """Test-only wrapper: records each call's attention input and cache."""

    def __init__(self, inner: nn.Module, sink: Callable[[tuple[mx.array, Any]], None]) -> None:
        super().__init__()
        self.inner = inner
        self.sink = sink

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        out = self.inner(x, mask, cache)
        self.sink((x, cache))
        return out


def _reference_scores(path: Path, tokens: list[int], window: int) -> np.ndarray:
    """The documented aggregation, in float64 on an unwrapped model run in one call: per layer,
    the window's attention averaged over its queries, max over heads; then mean over layers."""
    model, _ = mlx_lm.load(str(path))
    caches = make_prompt_cache(model)
    seen: list[tuple[mx.array, Any]] = []
    attns = []
    for layer, cache in zip(model.layers, caches, strict=True):
        if type(cache) is KVCache and "self_attn" in layer:
            attns.append(layer.self_attn)
            layer.self_attn = _Recorder(layer.self_attn, seen.append)
    model(mx.array([tokens]), cache=caches)
    assert len(seen) == len(attns) > 0
    n, w = len(tokens), min(window, len(tokens))
    rows = []
    for attn, (x, cache) in zip(attns, seen, strict=True):
        queries, _ = project_queries(attn, query_layout(attn), x[:, -w:], n - w)
        keys = np.array(cache.state[0][..., :n, :], dtype=np.float64)
        probs = _reference_attention(np.array(queries, dtype=np.float64), keys, float(attn.scale))
        rows.append(probs.mean(axis=2).max(axis=1)[0])
    return np.mean(rows, axis=0)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_lm", "llama"])
def test_scores_follow_the_window_of_last_queries(
    arch: str, scorers: dict[str, DraftScorer], draft_paths: dict[str, Path], tokens: list[int]
) -> None:
    """Against the reference computed by mlx_lm's plain forward in one call (for the hybrid
    draft scored through mlx_vlm too: the library does not change the scores)."""
    scorer = scorers[arch]
    arch = arch.removesuffix("_lm")
    if arch == "llama":
        assert scorer.info.attention_layers == 2  # the mean over layers is exercised
    by_window = {}
    for window in (1, 5, 16):
        scores, _ = _run(scorer, tokens, chunk=64, window=window)
        np.testing.assert_allclose(scores, _reference_scores(draft_paths[arch], tokens, window), rtol=1e-4, atol=1e-7)
        by_window[window] = np.array(scores)
    # one query: each head's row is a distribution; the max over heads sums to >= 1
    assert by_window[1].sum() >= 1.0 - 1e-5
    assert not np.allclose(by_window[1], by_window[16])
    # a prompt shorter than the window: every position is a query
    short = tokens[:10]
    scores, steps = _run(scorer, short, chunk=3, window=16)
    assert steps == 1
    np.testing.assert_allclose(scores, _reference_scores(draft_paths[arch], short, 16), rtol=1e-4, atol=1e-7)


def test_the_hybrid_draft_scores_the_same_through_mlx_vlm_as_through_mlx_lm(
    scorers: dict[str, DraftScorer], tokens: list[int]
) -> None:
    """The point of loading a qwen3_5 draft through mlx_vlm (its GatedDeltaNet prefill a chunked
    scan, mlx_lm's a per-token loop): float32 on CPU, the same scores to float32 rounding and
    the same kept chunks, whatever the draft chunking and the query window."""
    vlm, lm = scorers["qwen3_5"], scorers["qwen3_5_lm"]
    assert (vlm.info.library, lm.info.library) == ("mlx-vlm", "mlx-lm")
    assert vlm.info.attention_layers == lm.info.attention_layers == 1
    for chunk, window in ((10_000, 16), (64, 16), (37, 5), (100, 1)):
        a, _ = _run(vlm, tokens, chunk=chunk, window=window)
        b, _ = _run(lm, tokens, chunk=chunk, window=window)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
        for size, keep in ((8, 0.3), (16, 0.2), (4, 0.5)):
            picked = select_chunks(a, start=0, chunk_size=size, keep_fraction=keep)
            assert picked == select_chunks(b, start=0, chunk_size=size, keep_fraction=keep)


def test_interleaved_jobs_do_not_disturb_each_other(scorers: dict[str, DraftScorer], tokens: list[int]) -> None:
    """Each job has its own cache and the probes are armed only inside a final chunk's step."""
    scorer = scorers["llama"]
    alone_a, _ = _run(scorer, tokens, chunk=40, window=16)
    alone_b, _ = _run(scorer, tokens[:97], chunk=30, window=4)
    a, b = scorer.start(tokens, chunk=40, window=16), scorer.start(tokens[:97], chunk=30, window=4)
    results: dict[str, list[float]] = {}
    while len(results) < 2:
        for name, job in (("a", a), ("b", b)):
            if not job.finished and (scores := job.step()) is not None:
                results[name] = scores
    np.testing.assert_array_equal(results["a"], alone_a)
    np.testing.assert_array_equal(results["b"], alone_b)


def test_empty_prompt_and_early_close(scorers: dict[str, DraftScorer], tokens: list[int]) -> None:
    scorer = scorers["qwen3_5"]
    job = scorer.start([], chunk=8, window=4)
    assert job.step() == []
    assert job.finished
    job = scorer.start(tokens, chunk=32, window=16)
    assert job.step() is None
    job.close()
    job.close()  # idempotent
    assert job.finished
    with pytest.raises(RuntimeError):
        job.step()
    assert all(probe.collector is None for probe in scorer._probes)


def test_info(
    scorers: dict[str, DraftScorer], draft_paths: dict[str, Path], tiny_checkpoints: dict[str, Path],
    target_tokenizer: Any, tokens: list[int],
) -> None:
    info = scorers["qwen3_5"].info
    assert info.path == str(draft_paths["qwen3_5"])
    assert info.model_type == "qwen3_5"
    assert info.library == "mlx-vlm"
    assert info.attention_layers == 1
    assert info.load_seconds > 0
    assert scorers["qwen3_5_lm"].info.model_type == "qwen3_5"
    assert scorers["qwen3"].info.model_type == "qwen3"
    assert scorers["qwen3"].info.library == "mlx-lm"
    assert scorers["qwen3"].info.attention_layers == 2
    sliding = DraftScorer.load(tiny_checkpoints["llama_sliding"], target_tokenizer)
    assert sliding.info.attention_layers == 1  # the sliding-window layer is not probed
    assert not isinstance(sliding.model.layers[0].self_attn, QueryProbe)
    assert isinstance(sliding.model.layers[1].self_attn, QueryProbe)
    scores, _ = _run(sliding, tokens, chunk=50, window=16)
    assert len(scores) == len(tokens) and min(scores) >= 0.0


# --------------------------------------------------------------------------- 5. refusals


def test_another_vocabulary_is_refused(draft_path: Path, target_tokenizer: Any, tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(draft_path, other)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        text = (other / name).read_text()
        assert "<|box_start|>" in text
        (other / name).write_text(text.replace("<|box_start|>", "<|box_begin|>"))
    with pytest.raises(DraftIncompatible, match="vocabulary") as raised:
        DraftScorer.load(other, target_tokenizer)
    assert isinstance(raised.value, ModelLoadError)


@pytest.mark.parametrize(("arch", "reason"), [("phi3", "no attention layer"), ("gemma2", "does not reproduce")])
def test_attention_the_probes_cannot_rebuild_is_refused(
    arch: str, reason: str, tiny_checkpoints: dict[str, Path], target_tokenizer: Any
) -> None:
    with pytest.raises(DraftIncompatible, match=reason):
        DraftScorer.load(tiny_checkpoints[arch], target_tokenizer)


def test_a_missing_draft_is_a_load_error(tmp_path: Path, target_tokenizer: Any) -> None:
    with pytest.raises(ModelLoadError):
        DraftScorer.load(tmp_path / "nothing-here", target_tokenizer)


# --------------------------------------------------------------------------- 6. a broken draft


def test_a_draft_producing_inf_fails_the_scoring(
    draft_path: Path, target_tokenizer: Any, tokens: list[int], tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(draft_path, broken)
    weights = broken / "model.safetensors"
    with safe_open(str(weights), "numpy") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    name = "model.language_model.layers.3.input_layernorm.weight"
    tensors[name] = np.full_like(tensors[name], np.inf)
    save_file(tensors, str(weights), metadata=metadata)

    scorer = DraftScorer.load(broken, target_tokenizer)  # loads: a broken draft is not an incompatible one
    job = scorer.start(tokens, chunk=64, window=16)
    with pytest.raises(ScoringFailed, match="not finite") as raised:
        while job.step() is None:
            pass
    assert isinstance(raised.value, GenerationFailed)
    assert job.finished
    assert all(probe.collector is None for probe in scorer._probes)

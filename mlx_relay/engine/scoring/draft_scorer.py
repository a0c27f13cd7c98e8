"""SpecPrefill's draft model: scores how much each prompt token matters (GPU thread only).

SpecPrefill prefills a long prompt sparsely: a small *draft* model that shares the target's
tokenizer reads the whole prompt, and the attention that the prompt's last ``window`` query
positions pay to each token is that token's importance. The engine's scoring stage
(:mod:`mlx_relay.engine.scoring.stage`) runs the work here, on the GPUExecutor's thread and nowhere
else (MLX arrays never leave it), one draft chunk per engine step so that the other requests'
decode steps go on between the chunks of a long prompt. Which chunks of the prompt are then
kept is a pure function (:mod:`mlx_relay.specprefill.selection`); this module only produces the
scores.

* :meth:`DraftScorer.load` loads the draft through :mod:`mlx_relay.engine.scoring.draft_library`:
  a qwen3_5-family draft (hybrid GatedDeltaNet + gated attention) with ``mlx_vlm.load`` and
  its ``language_model``, any other with ``mlx_lm.load``. (Before, every draft went through
  mlx_lm, whose GatedDeltaNet prefill off Metal is a per-token loop: on CUDA a hybrid draft
  scored an 8K prompt slower than the target prefilled it; mlx-vlm's is a chunked scan. The
  scores do not depend on the library: tests/test_draft_scorer.py pins them equal.) It checks
  that the draft's vocabulary is the target's, and wraps the ``self_attn`` module of every full-attention layer
  in a :class:`QueryProbe`, then checks on a short sequence that the probes reconstruct each
  layer's attention exactly (:class:`DraftIncompatible` otherwise); what was loaded is
  :attr:`DraftScorer.info` (reported in the GPUExecutor's ``ModelInfo``).
* :meth:`DraftScorer.start` makes a :class:`ScoringJob`; each :meth:`ScoringJob.step` runs the
  draft over the next chunk with the job's own fresh cache and the last one returns the scores.

How the last queries' attention is read without patching library code: MLX has no forward
hooks, so the probe is module composition through MLX's public ``Module`` API (the mechanism
``nn.quantize`` uses to swap layers). The probe calls the wrapped attention unchanged (the
draft's outputs are bit-identical) and only while a job arms it, during the final chunk, it also

1. rebuilds the queries of the chunk's last ``window`` positions from the attention input ``x``
   exactly as the library module does (:func:`project_queries`: ``q_proj``, the gate split of
   qwen3_next/qwen3_5 gated attention, ``q_norm`` when present, RoPE at the queries' absolute
   positions: mlx_lm's ``rope`` or mlx_vlm's multimodal ``rotary_emb``);
2. takes every key so far, post-RoPE, from the layer's ``KVCache`` (trimmed to its offset:
   :func:`mlx_relay.engine.scoring.draft_library.cached_keys_values` reads either library's);
3. computes the attention probabilities in float32: ``softmax(q . k * scale)`` with grouped
   query heads, causal among the window's own positions (:func:`window_attention`).

Aggregation (the score): per layer, the mean over the window's queries, then the max over the
heads -- a token that any head relies on counts, averaged over the question's last positions
so one noisy query does not decide -- and then the mean over the draft's attention layers. Each
layer's vector sums to between 1 and the number of heads. The scores are finite and >= 0 unless
the draft itself produced inf or nan (a broken fp16 draft, say), which :meth:`ScoringJob.step`
reports as :class:`ScoringFailed`.
Memory: one layer's probabilities are ``heads x window x prompt`` float32 values (32 heads,
a window of 16 and a 32K prompt: 64 MiB), evaluated lazily layer by layer.

Supported draft attention: llama-style (``n_heads``, no query norm), qwen3 (``q_norm``) and
qwen3_next / qwen3_5 gated attention (``q_proj`` doubled to queries + gate; mlx_lm's or
mlx_vlm's module), on layers whose cache is a plain ``KVCache`` of either library; layers
with another cache (sliding windows, linear attention) are left out of the scores. Anything
whose attention the probes cannot reproduce on the load-time check is refused with
:class:`DraftIncompatible`.

No state lives at module level: what a scoring pass collects belongs to its job, and the probes
hold a reference to it only while that job's final chunk runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np

from mlx_relay.engine.scoring.draft_library import (
    DraftLibrary,
    cache_arrays,
    cached_keys_values,
    has_rotation,
    is_attention_cache,
    load_draft,
    make_cache,
    rotate_queries,
)
from mlx_relay.errors import GenerationFailed, ModelLoadError
from mlx_relay.messages.gpu import DraftInfo

__all__ = [
    "DraftIncompatible",
    "DraftScorer",
    "QueryLayout",
    "QueryProbe",
    "ScoringFailed",
    "ScoringJob",
    "chunk_bounds",
    "project_queries",
    "query_layout",
    "window_attention",
]

#: Tokens of the load-time check: a first chunk, then a second one whose every query is probed
#: (so the check covers RoPE offsets, keys from an earlier chunk and the causal window).
_CHECK_TOKENS: Final[int] = 16
_CHECK_SPLIT: Final[int] = 7
#: Largest relative error of a reconstructed attention output on the load-time check.
_CHECK_TOLERANCE_FP32: Final[float] = 1e-3
_CHECK_TOLERANCE_HALF: Final[float] = 5e-2


class DraftIncompatible(ModelLoadError):
    """The draft cannot score the target's prompts: another vocabulary, or no attention layer
    whose queries the probes can reconstruct."""


class ScoringFailed(GenerationFailed):
    """The draft's scores of a prompt are unusable (not finite, say): SpecPrefill cannot run."""


# --------------------------------------------------------------------------- queries


@dataclass(frozen=True)
class QueryLayout:
    """How one attention module's ``q_proj`` output becomes its queries."""

    n_heads: int
    head_dim: int
    gated: bool  # qwen3_next / qwen3_5: q_proj yields queries and an output gate per head


def _out_features(linear: Any) -> int | None:
    weight = getattr(linear, "weight", None)
    # Linear and QuantizedLinear both keep the output features on the first axis.
    return int(weight.shape[0]) if isinstance(weight, mx.array) and weight.ndim == 2 else None


def query_layout(attn: nn.Module) -> QueryLayout:
    """The query layout of ``attn`` (llama, qwen3 or qwen3_next-style), else DraftIncompatible."""
    name = type(attn).__name__
    n_heads = getattr(attn, "num_attention_heads", None) or getattr(attn, "n_heads", None)
    q_out = _out_features(getattr(attn, "q_proj", None))
    if not isinstance(n_heads, int) or n_heads <= 0 or q_out is None:
        raise DraftIncompatible(f"{name}: no q_proj / head count to rebuild its queries from")
    if getattr(attn, "scale", None) is None:
        raise DraftIncompatible(f"{name}: no 'scale' attribute")
    if not has_rotation(attn):
        raise DraftIncompatible(f"{name}: no 'rope' or 'rotary_emb' to rotate its queries with")
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int):
        q_norm = getattr(attn, "q_norm", None)
        n_kv = getattr(attn, "num_key_value_heads", None) or getattr(attn, "n_kv_heads", None)
        k_out = _out_features(getattr(attn, "k_proj", None))
        norm_weight = getattr(q_norm, "weight", None)
        if isinstance(norm_weight, mx.array) and norm_weight.ndim == 1:
            head_dim = int(norm_weight.shape[0])
        elif isinstance(n_kv, int) and n_kv > 0 and k_out is not None:
            head_dim = k_out // n_kv
        else:
            head_dim = q_out // n_heads
    if q_out == 2 * n_heads * head_dim:
        return QueryLayout(n_heads, head_dim, gated=True)
    if q_out == n_heads * head_dim:
        return QueryLayout(n_heads, head_dim, gated=False)
    raise DraftIncompatible(f"{name}: q_proj has {q_out} outputs for {n_heads} heads of {head_dim}")


def project_queries(
    attn: nn.Module, layout: QueryLayout, x: mx.array, offset: int
) -> tuple[mx.array, mx.array | None]:
    """The queries ``attn`` computes from its input ``x`` (B, L, D) whose first position is
    ``offset``: (B, heads, L, head_dim), normed and rotated as the module does, and for gated
    attention the output gate (B, L, heads * head_dim), else None."""
    B, L, _ = x.shape
    q = attn.q_proj(x)
    gate: mx.array | None = None
    if layout.gated:
        q, gate = mx.split(q.reshape(B, L, layout.n_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
    else:
        q = q.reshape(B, L, layout.n_heads, layout.head_dim)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = rotate_queries(attn, q.transpose(0, 2, 1, 3), offset)
    return q, gate


def window_attention(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """Attention probabilities (float32, (B, heads, W, N)) of ``queries`` (B, heads, W, D) at the
    last W of N positions over ``keys`` (B, kv_heads, N, D); heads share kv heads in groups
    (head h reads kv head h // (heads / kv_heads)), and query i sees keys 0 .. N - W + i."""
    B, H, W, D = queries.shape
    n_kv, N = keys.shape[1], keys.shape[2]
    if H % n_kv or W > N:
        raise ScoringFailed(f"cannot attend {H} query heads x {W} positions to {n_kv} kv heads x {N} keys")
    q = queries.astype(mx.float32).reshape(B, n_kv, (H // n_kv) * W, D)
    k = keys.astype(mx.float32)
    logits = (q @ k.transpose(0, 1, 3, 2)).reshape(B, H, W, N) * scale
    visible = mx.arange(N)[None, :] <= mx.arange(N - W, N)[:, None]
    logits = mx.where(visible, logits, mx.array(-mx.inf, dtype=mx.float32))
    return mx.softmax(logits, axis=-1)


# --------------------------------------------------------------------------- the probe


@dataclass
class _Collector:
    """What one armed forward gathers, one entry per probed layer in call order (owned by the
    job; the probes point at it only while the job's final chunk runs)."""

    window: int
    check: bool = False  # load-time check: also rebuild each layer's output and compare
    rows: list[mx.array] = field(default_factory=list)
    errors: list[float | None] = field(default_factory=list)  # check: relative error, None: not finite


class QueryProbe(nn.Module):
    """Wraps one attention module: calls it unchanged and, while armed, also reads the attention
    of the chunk's last queries to every key in the layer's cache.

    The wrapped module becomes the child ``inner``, so the draft's parameter names gain an
    ``.inner`` (``layers.3.self_attn.inner.q_proj.weight``): load weights before wrapping."""

    def __init__(self, inner: nn.Module, layout: QueryLayout) -> None:
        super().__init__()
        self.inner = inner
        self.layout = layout
        self.collector: _Collector | None = None

    def __getattr__(self, key: str) -> Any:
        """Attributes the probe lacks are the wrapped module's: library code reads them through
        the layer (mlx_vlm's qwen3_5 backbone reads ``self_attn.rotary_emb``, say)."""
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = self.get("inner")
            if inner is None:
                raise
            return getattr(inner, key)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.inner(x, *args, **kwargs)
        collector = self.collector
        if collector is not None:
            cache = kwargs["cache"] if "cache" in kwargs else (args[1] if len(args) > 1 else None)
            if kwargs.get("position_ids") is not None or kwargs.get("position_embeddings") is not None:
                # the queries are rebuilt at the cache's positions (the scorer passes none)
                raise ScoringFailed("probed attention got explicit positions")
            self._collect(collector, x, out, cache)
        return out

    def _collect(self, collector: _Collector, x: mx.array, out: mx.array, cache: Any) -> None:
        if not is_attention_cache(cache):
            raise ScoringFailed(f"probed attention got a {type(cache).__name__} cache, not a KVCache")
        keys, values, offset = cached_keys_values(cache)
        window = min(collector.window, x.shape[1])
        xw = x[:, -window:, :]
        queries, gate = project_queries(self.inner, self.layout, xw, offset - window)
        probs = window_attention(queries, keys, float(self.inner.scale))
        collector.rows.append(probs.mean(axis=2).max(axis=1)[0])
        if collector.check:
            collector.errors.append(self._check(probs, values, gate, out[:, -window:, :]))

    def _check(self, probs: mx.array, values: mx.array, gate: mx.array | None, expected: mx.array) -> float | None:
        """Relative error of the attention output rebuilt from ``probs`` against the module's."""
        B, H, W, N = probs.shape
        n_kv = values.shape[1]
        mixed = probs.reshape(B, n_kv, (H // n_kv) * W, N) @ values.astype(mx.float32)
        mixed = mixed.reshape(B, H, W, -1).transpose(0, 2, 1, 3).reshape(B, W, -1)
        if gate is not None:
            mixed = mixed * mx.sigmoid(gate.astype(mx.float32))
        rebuilt = self.inner.o_proj(mixed.astype(expected.dtype)).astype(mx.float32)
        ref = expected.astype(mx.float32)
        if not (mx.all(mx.isfinite(ref)).item() and mx.all(mx.isfinite(rebuilt)).item()):
            return None
        return float(mx.max(mx.abs(rebuilt - ref)).item()) / max(float(mx.max(mx.abs(ref)).item()), 1e-6)


# --------------------------------------------------------------------------- scorer and jobs


def chunk_bounds(n: int, chunk: int, window: int) -> list[tuple[int, int]]:
    """Chunks ``[a, b)`` over ``n`` tokens of at most ``chunk`` tokens each, except that the last
    one holds at least ``min(window, n)`` tokens (it is the one whose queries are read)."""
    if chunk < 1 or window < 1:
        raise ValueError(f"chunk and window must be >= 1 (got chunk={chunk}, window={window})")
    if n <= 0:
        return []
    last = max(n - (n - 1) // chunk * chunk, min(window, n))
    head = n - last
    bounds = [(a, min(a + chunk, head)) for a in range(0, head, chunk)]
    bounds.append((head, n))
    return bounds


def _vocab(tokenizer: Any) -> dict[str, int]:
    """``get_vocab()`` of a HF tokenizer, an mlx_lm TokenizerWrapper or a processor."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None and getattr(tokenizer, "tokenizer", None) is not None:
        get_vocab = tokenizer.tokenizer.get_vocab
    if get_vocab is None:
        raise DraftIncompatible(f"cannot read the vocabulary of a {type(tokenizer).__name__}")
    return dict(get_vocab())


class DraftScorer:
    """The loaded draft model with probes on its attention layers (GPU thread only)."""

    def __init__(self, model: nn.Module, probes: Sequence[QueryProbe], info: DraftInfo) -> None:
        self.model = model
        self.info = info
        self._probes = tuple(probes)
        self._backbone = self._find_backbone(model)

    @classmethod
    def load(cls, path: Path, target_tokenizer: Any, *, library: DraftLibrary | None = None) -> DraftScorer:
        """Load the draft at ``path`` (a local checkpoint), through ``library`` (default: mlx-vlm
        for a qwen3_5-family draft, mlx-lm for any other; see :mod:`~mlx_relay.engine.scoring.draft_library`).

        Raises ModelLoadError when it cannot be loaded, DraftIncompatible when its vocabulary
        differs from ``target_tokenizer``'s or none of its attention layers can be probed."""
        started = time.perf_counter()
        try:
            loaded = load_draft(path, library)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the SpecPrefill draft model {path}: {exc}") from exc
        model = loaded.model
        vocab, target_vocab = _vocab(loaded.tokenizer), _vocab(target_tokenizer)
        if vocab != target_vocab:
            differing = sorted(set(vocab.items()) ^ set(target_vocab.items()))[:3]
            raise DraftIncompatible(
                f"the draft {path} has another vocabulary than the model ({len(vocab)} vs "
                f"{len(target_vocab)} tokens; e.g. {differing})"
            )
        probes = cls._wrap(model)
        scorer = cls(model, probes, DraftInfo(str(path), loaded.model_type, len(probes), 0.0, loaded.library))
        scorer._check(sorted(vocab.values()))
        scorer.info = msgspec.structs.replace(scorer.info, load_seconds=time.perf_counter() - started)
        return scorer

    @staticmethod
    def _wrap(model: nn.Module) -> list[QueryProbe]:
        """Wraps every full-attention layer's ``self_attn`` whose cache is a plain KVCache."""
        layers = list(getattr(model, "layers", None) or [])
        caches = make_cache(model)
        if not layers or len(caches) != len(layers):
            raise DraftIncompatible(f"{type(model).__module__}: cannot pair its layers with their caches")
        probes: list[QueryProbe] = []
        reasons: list[str] = []
        for index, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
            attn = layer.get("self_attn") if isinstance(layer, nn.Module) else None
            if not isinstance(attn, nn.Module):
                continue
            if not is_attention_cache(cache):
                reasons.append(f"layer {index}: {type(cache).__name__} cache")
                continue
            try:
                layout = query_layout(attn)
            except DraftIncompatible as exc:
                reasons.append(f"layer {index}: {exc}")
                continue
            probe = QueryProbe(attn, layout)
            layer.update_modules({"self_attn": probe})
            probes.append(probe)
        if not probes:
            detail = "; ".join(reasons[:3]) or "no self_attn layers"
            raise DraftIncompatible(f"{type(model).__module__}: no attention layer to score with ({detail})")
        return probes

    def _find_backbone(self, model: nn.Module) -> nn.Module | None:
        """The module under the LM head that returns hidden states (``model.model``, which
        qwen3_5's VLM wrapper exposes as ``language_model.model``), when it owns the probed layers:
        scoring never needs the logits."""
        backbone = getattr(model, "model", None)
        layers = getattr(backbone, "layers", None)
        if not isinstance(backbone, nn.Module) or not isinstance(layers, list):
            return None
        owned = {id(layer.get("self_attn")) for layer in layers if isinstance(layer, nn.Module)}
        return backbone if all(id(probe) in owned for probe in self._probes) else None

    def _forward(self, tokens: Sequence[int], cache: list[Any]) -> None:
        inputs = mx.array([list(tokens)], dtype=mx.int32)
        if self._backbone is not None:
            self._backbone(inputs, cache=cache)
        else:
            self.model(inputs, cache=cache)

    @contextmanager
    def _armed(self, collector: _Collector) -> Iterator[None]:
        for probe in self._probes:
            probe.collector = collector
        try:
            yield
        finally:
            for probe in self._probes:
                probe.collector = None

    def _collect(self, tokens: Sequence[int], cache: list[Any], collector: _Collector) -> None:
        """One armed forward over ``tokens``; the collector gets one row per probed layer."""
        with self._armed(collector):
            self._forward(tokens, cache)
        if len(collector.rows) != len(self._probes):
            raise ScoringFailed(f"{len(collector.rows)} of the draft's {len(self._probes)} probed layers ran")

    def _check(self, vocab_ids: Sequence[int]) -> None:
        """Load-time check: on a short sequence in two chunks, each probe's rebuilt attention
        output must match its module's own (DraftIncompatible otherwise). A draft whose output is
        not finite leaves that layer unchecked: its scores will fail with ScoringFailed anyway."""
        step = max(1, len(vocab_ids) // _CHECK_TOKENS)
        tokens = [vocab_ids[(i * step + 3) % len(vocab_ids)] for i in range(_CHECK_TOKENS)]
        cache = make_cache(self.model)
        collector = _Collector(window=_CHECK_TOKENS - _CHECK_SPLIT, check=True)
        try:
            self._forward(tokens[:_CHECK_SPLIT], cache)
            self._collect(tokens[_CHECK_SPLIT:], cache, collector)
        except DraftIncompatible:
            raise
        except Exception as exc:
            raise DraftIncompatible(f"the probes cannot rebuild the draft's attention: {exc}") from exc
        for index, (probe, error) in enumerate(zip(self._probes, collector.errors, strict=True)):
            tolerance = _CHECK_TOLERANCE_FP32 if self._is_fp32(probe) else _CHECK_TOLERANCE_HALF
            if error is not None and error > tolerance:
                raise DraftIncompatible(
                    f"probed attention layer {index} ({type(probe.inner).__name__}) does not reproduce the "
                    f"module's output (relative error {error:.2e} > {tolerance:.0e})"
                )

    @staticmethod
    def _is_fp32(probe: QueryProbe) -> bool:
        weight = getattr(probe.inner.q_proj, "weight", None)
        scales = getattr(probe.inner.q_proj, "scales", None)
        return isinstance(weight, mx.array) and weight.dtype == mx.float32 and scales is None

    def start(self, tokens: list[int], *, chunk: int, window: int) -> ScoringJob:
        """A job scoring ``tokens``: ``chunk`` tokens per step, the last ``window`` queries read."""
        return ScoringJob(self, tokens, chunk=chunk, window=window)


class ScoringJob:
    """Scores one prompt, one draft chunk per :meth:`step` (GPU thread only)."""

    def __init__(self, scorer: DraftScorer, tokens: Sequence[int], *, chunk: int, window: int) -> None:
        self._scorer: DraftScorer | None = scorer
        self._tokens = list(tokens)
        self._window = min(window, len(self._tokens))
        self._bounds = chunk_bounds(len(self._tokens), chunk, window)
        self._next = 0
        self._cache: list[Any] | None = None
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def chunks(self) -> int:
        """How many steps the whole job takes."""
        return max(1, len(self._bounds))

    def step(self) -> list[float] | None:
        """Runs the draft over the next chunk; None until the last, which returns the scores (one
        per token, finite and >= 0; ScoringFailed otherwise). The job's cache is freed when it
        finishes, succeeds or fails."""
        scorer = self._scorer
        if self._finished or scorer is None:
            raise RuntimeError("this scoring job has finished")
        if not self._bounds:
            self.close()
            return []
        try:
            if self._cache is None:
                self._cache = make_cache(scorer.model)
            a, b = self._bounds[self._next]
            self._next += 1
            if self._next < len(self._bounds):
                scorer._forward(self._tokens[a:b], self._cache)
                mx.eval(cache_arrays(self._cache))
                return None
            collector = _Collector(window=self._window)
            scorer._collect(self._tokens[a:b], self._cache, collector)
            scores = mx.stack(collector.rows).mean(axis=0)
            collector.rows.clear()
            values = np.array(scores, dtype=np.float32)
            del scores
        except BaseException:
            self.close()
            raise
        self.close()
        if values.shape != (len(self._tokens),):
            raise ScoringFailed(f"the draft scored {values.shape} positions for {len(self._tokens)} tokens")
        if not np.all(np.isfinite(values)):
            bad = int(np.count_nonzero(~np.isfinite(values)))
            raise ScoringFailed(f"the draft's attention is not finite at {bad} of {len(values)} positions")
        if np.any(values < 0):
            raise ScoringFailed("the draft's attention scores are negative")
        return [float(v) for v in values]

    def close(self) -> None:
        """Drops the cache (the request was cancelled, or the job is done); idempotent."""
        self._cache = None
        self._scorer = None
        self._finished = True

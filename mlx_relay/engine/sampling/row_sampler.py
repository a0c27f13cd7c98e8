"""Per-request sampling inside a shared continuous batch (runs on the GPU thread).

The lanes take one argmax over the whole batch but apply logits processors row by row. A request
that samples (temperature > 0) gets a `RowSampler` processor: it applies temperature, top-k, top-p
and min-p to its own row, draws the token with its own PRNG key (seeded per request, so the draw
does not depend on what else is in the batch) and returns a row whose only finite entry is that
token. The batch-wide sampler is argmax, so greedy requests carry no processor at all and stay
exactly equal to plain greedy decoding."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_relay.messages.gpu import SamplingParams


class RowSampler:
    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        token = mx.random.categorical(processed_logprobs(self.params, logits), key=self.next_key())
        vocab = mx.arange(logits.shape[-1])
        return mx.where(vocab == token[:, None], 0.0, -mx.inf).astype(logits.dtype)


def processed_logprobs(p: SamplingParams, logits: mx.array) -> mx.array:
    """Log-probabilities after temperature, top-k, top-p and min-p (the distribution sampled)."""
    logprobs = logits.astype(mx.float32) / p.temperature
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < p.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, p.top_k)
    if 0.0 < p.top_p < 1.0:
        logprobs = apply_top_p(logprobs, p.top_p)
    if p.min_p > 0.0:
        logprobs = apply_min_p(logprobs, p.min_p)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


def needs_sampler(params: SamplingParams) -> bool:
    return params.temperature > 0.0

"""The MTP round's verify forward, two ways (GPU thread only; used by `mtp_cohort.EagerCohort`).

Each verifier runs the target over a block ``[bonus, d_1 .. d_{k-1}]`` per row and answers the
target's last hidden states [B, k, H] with what `commit_speculative_round` needs to keep exactly
``accepted + 1`` positions per row (mlx-vlm's public speculative cache transaction):

- `ExactVerifier`: the LanguageModel's speculative-verify call (batch-invariant: bit-identical to
  one-token decode, but on CUDA and CPU every quantized linear runs once per row and position);
  it records the GatedDeltaNet states per position itself. It runs the whole model in one call,
  so a pipeline stage cannot use it.
- `BatchedVerifier`: `start_speculative_cache`, then the model's (or this pipeline stage's)
  ordinary forward, one matmul per linear for the whole block (the engine's default off Metal).
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx
from mlx_vlm.speculative.cache_state import abort_speculative_round, start_speculative_cache

from mlx_relay.engine.memory.batch_caches import batched


class Verifier(Protocol):
    def __call__(self, block: mx.array, cache: list[Any]) -> tuple[mx.array, Any]:
        """The target's last hidden states over `block` [B, k] and the open cache transaction."""
        ...


class ExactVerifier:
    """mlx-vlm's batch-invariant speculative-verify forward (the whole model)."""

    def __init__(self, lm: Any) -> None:
        self.lm = lm

    def __call__(self, block: mx.array, cache: list[Any]) -> tuple[mx.array, Any]:
        deltas = mx.zeros((block.shape[0], 1), dtype=mx.int32)
        out = self.lm(block, cache=cache, speculative_verify=True, return_hidden=True,
                      return_shared_kv=True, skip_logits=True, rope_deltas=deltas)
        return out.hidden_states[-1], out.gdn_states


class BatchedVerifier:
    """One batched forward of `run` (the model, or this pipeline stage of it) inside a speculative
    cache transaction."""

    def __init__(self, run: Any) -> None:
        self._run = run

    def __call__(self, block: mx.array, cache: list[Any]) -> tuple[mx.array, Any]:
        deltas = mx.zeros((block.shape[0], 1), dtype=mx.int32)
        txn = start_speculative_cache(cache, block.shape[1])
        try:
            # one forward for the whole batch: the model's per-row path would run over re-merged
            # (untracked) caches
            out = self._run(block, cache=cache, **batched(return_hidden=True, skip_logits=True, rope_deltas=deltas))
        except BaseException:
            abort_speculative_round(txn)
            raise
        return out.hidden_states[-1], txn

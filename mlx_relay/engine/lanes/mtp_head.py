"""The checkpoint's own MTP head as a batched drafter (runs on the GPU thread only).

mlx-vlm's `Qwen3_5MTPDraftModel` keeps one private cache and one seed for a whole batch, so
rows cannot join or leave a running batch. We reuse its modules and weights (loaded by the
library's public `load_drafter`), and keep the state ourselves: a per-cohort list of batch KV
caches that joins, filters and rolls back like the target's. The forward is the head's
documented one:

    h' = norm(layers(fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])))

with the target's own `embed_tokens` and head (`speculative_logits_from_hidden` /
`speculative_argmax_from_hidden`), so the head costs no extra copy of either.

The family's code (loading the head from its checkpoint layouts, its input) lives in the model's
family (`models.ModelFamily`; Qwen3.5: `models/qwen3_5/mtp.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import KVCache

from mlx_relay.engine.models import family_for, family_of


def load_mtp_drafter(path: Path) -> Any:
    """The checkpoint's MTP head as its family loads it (`UnsupportedModel` for a model type of no family)."""
    config = json.loads((path / "config.json").read_text())
    return family_for(str(config.get("model_type"))).load_mtp_drafter(path, config)


class MTPHead:
    """`exact`: the target's head through mlx-vlm's batch-invariant speculative calls (bit-identical
    to one-token decode); otherwise its ordinary `lm_head` (one matmul for all rows/positions).
    With no `drafter` (a checkpoint without an MTP head, whose lane verifies context drafts only)
    it is the target's output head alone: `logits` and `argmax`, no cache, no forward."""

    def __init__(self, drafter: Any | None, lm: Any, *, exact: bool = True) -> None:
        self.drafter = drafter
        self.lm = lm
        self.exact = exact
        self.family = family_of(lm)

    @classmethod
    def load(cls, path: Path, lm: Any, *, exact: bool = True) -> MTPHead:
        return cls(load_mtp_drafter(path), lm, exact=exact)

    @property
    def drafts(self) -> bool:
        """Whether there is a head that drafts (else only the target's output head)."""
        return self.drafter is not None

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.drafter.layers] if self.drafter is not None else []

    def forward(self, tokens: mx.array, hidden: mx.array, cache: list[Any], positions: mx.array) -> mx.array:
        """tokens [B, T] (tok_{t+1}), hidden [B, T, H] (the target's h_t), positions [B, T]."""
        d = self.drafter
        assert d is not None, "no MTP head to run"
        h = self.family.mtp_input(self.lm, d, tokens, hidden)
        for layer, layer_cache in zip(d.layers, cache, strict=True):
            mask = create_attention_mask(h, layer_cache)
            h = layer(h, mask=mask, cache=layer_cache, position_ids=positions)
        return d.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.exact:
            return self.lm.speculative_logits_from_hidden(hidden)
        return self.family.logits(self.lm, hidden)

    def argmax(self, hidden: mx.array) -> mx.array:
        out = self.lm.speculative_argmax_from_hidden(hidden) if self.exact else None
        return out if out is not None else mx.argmax(self.logits(hidden), axis=-1)

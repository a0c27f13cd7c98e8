"""The checkpoint's own MTP head as a batched drafter (runs on the GPU thread only).

mlx-vlm's `Qwen3_5MTPDraftModel` keeps one private cache and one seed for a whole batch, so
rows cannot join or leave a running batch. We reuse its modules and weights (loaded by the
library's public `load_drafter`), and keep the state ourselves: a per-cohort list of batch KV
caches that joins, filters and rolls back like the target's. The forward is the head's
documented one:

    h' = norm(layers(fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])))

with the target's own `embed_tokens` and head (`speculative_logits_from_hidden` /
`speculative_argmax_from_hidden`), so the head costs no extra copy of either.

Text-only checkpoints (`model_type: qwen3_5_text`): mlx-vlm 0.7.10 registers its MTP splitters
under the VLM family names only, and `load_drafter` on such a checkpoint silently falls back to
loading the whole target model instead of the head. `load_mtp_drafter` asks the public splitter
registry for the family's splitter by name (pinned by tests/test_text_only.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_vlm.models.base import create_attention_mask
from mlx_vlm.models.cache import KVCache

from mlx_relay.errors import ModelLoadError

#: Text-only model types -> the VLM family whose MTP splitter reads their `mtp.*` tensors.
TEXT_ONLY_FAMILIES: dict[str, str] = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def load_mtp_drafter(path: Path) -> Any:
    """The checkpoint's MTP head as mlx-vlm's drafter module, for VLM and text-only layouts."""
    import json

    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter

    config = json.loads((path / "config.json").read_text())
    family = TEXT_ONLY_FAMILIES.get(str(config.get("model_type")))
    if family is None:
        drafter, _kind = load_drafter(str(path), kind="mtp")
        return drafter
    splitter = get_mtp_splitter(family, source_config=config)
    if splitter is None:
        raise ModelLoadError(f"mlx-vlm has no MTP head loader for {family}")
    return splitter.load(path, source_config=config)


class MTPHead:
    """`exact`: the target's head through mlx-vlm's batch-invariant speculative calls (bit-identical
    to one-token decode); otherwise its ordinary `lm_head` (one matmul for all rows/positions)."""

    def __init__(self, drafter: Any, lm: Any, *, exact: bool = True) -> None:
        self.drafter = drafter
        self.lm = lm
        self.exact = exact
        inner = lm.model
        self._embed = inner.embed_tokens
        self._embed_scale = float(getattr(inner, "embed_scale", 1.0))

    @classmethod
    def load(cls, path: Path, lm: Any, *, exact: bool = True) -> MTPHead:
        return cls(load_mtp_drafter(path), lm, exact=exact)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.drafter.layers]

    def forward(self, tokens: mx.array, hidden: mx.array, cache: list[Any], positions: mx.array) -> mx.array:
        """tokens [B, T] (tok_{t+1}), hidden [B, T, H] (the target's h_t), positions [B, T]."""
        d = self.drafter
        emb = self._embed(tokens) * self._embed_scale
        h = mx.concatenate([d.pre_fc_norm_embedding(emb), d.pre_fc_norm_hidden(hidden)], axis=-1)
        h = d.fc(h)
        for layer, layer_cache in zip(d.layers, cache, strict=True):
            mask = create_attention_mask(h, layer_cache)
            h = layer(h, mask=mask, cache=layer_cache, position_ids=positions)
        return d.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        if self.exact:
            return self.lm.speculative_logits_from_hidden(hidden)
        if self.lm.args.tie_word_embeddings:
            return self.lm.model.embed_tokens.as_linear(hidden)
        return self.lm.lm_head(hidden)

    def argmax(self, hidden: mx.array) -> mx.array:
        out = self.lm.speculative_argmax_from_hidden(hidden) if self.exact else None
        return out if out is not None else mx.argmax(self.logits(hidden), axis=-1)

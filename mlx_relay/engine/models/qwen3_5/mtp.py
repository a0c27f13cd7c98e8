"""The Qwen3.5 family's MTP head (GPU thread only): loading it from a checkpoint, its input, and its
layers over explicit caches for the compiled round (`mtp_step.MTPStep`; the eager drafter,
`mtp_head.MTPHead`, runs the same input through the library's layers and caches).

The head's forward (mlx-vlm's `Qwen3_5MTPDraftModel` modules and weights, with the target's own
`embed_tokens` and head):

    h' = norm(layers(fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])))

Text-only checkpoints (`model_type: qwen3_5_text`): mlx-vlm 0.7.10 registers its MTP splitters
under the VLM family names only, and `load_drafter` on such a checkpoint silently falls back to
loading the whole target model instead of the head, so the splitter is asked for by the VLM
family's name (pinned by tests/test_text_only.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay.engine.models import KV, UnsupportedModel
from mlx_relay.engine.models.positions import Positions
from mlx_relay.engine.models.qwen3_5 import TEXT_ONLY_FAMILIES
from mlx_relay.engine.models.qwen3_5.layers import attention_layer, expert_rows, rope_periods
from mlx_relay.errors import ModelLoadError


def load_mtp_drafter(path: Path, config: dict[str, Any]) -> Any:
    """The checkpoint's MTP head as mlx-vlm's drafter module, for VLM and text-only layouts."""
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter

    family = TEXT_ONLY_FAMILIES.get(str(config.get("model_type")))
    if family is None:
        drafter, _kind = load_drafter(str(path), kind="mtp")
        return drafter
    splitter = get_mtp_splitter(family, source_config=config)
    if splitter is None:
        raise ModelLoadError(f"mlx-vlm has no MTP head loader for {family}")
    return splitter.load(path, source_config=config)


def check_mtp_head(drafter: Any) -> None:
    if not all(hasattr(layer, "self_attn") and not getattr(layer, "is_linear", False) for layer in drafter.layers):
        raise UnsupportedModel("the MTP head's layers are not full-attention layers")


def mtp_input(lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array) -> mx.array:
    """fc(concat[pre_fc_norm_embedding(embed(tokens)), pre_fc_norm_hidden(hidden)])."""
    emb = lm.model.embed_tokens(tokens) * float(getattr(lm.model, "embed_scale", 1.0))
    return drafter.fc(mx.concatenate([drafter.pre_fc_norm_embedding(emb), drafter.pre_fc_norm_hidden(hidden)],
                                     axis=-1))


def mtp_head(lm: Any, drafter: Any, tokens: mx.array, hidden: mx.array, head_kv: KV, at: Positions
             ) -> tuple[mx.array, KV]:
    """The head over pairs (tokens [B, T], hidden [B, T, H]), its keys and values written where `at` says."""
    h = mtp_input(lm, drafter, tokens, hidden)
    out_kv = []
    periods = rope_periods(drafter.layers) if at.offsets is not None else None
    rows = expert_rows(drafter.layers, tokens)
    for layer, (keys_buf, values_buf) in zip(drafter.layers, head_kv, strict=True):
        h, keys_buf, values_buf = attention_layer(layer, h, keys_buf, values_buf, at, periods, rows)
        out_kv.append((keys_buf, values_buf))
    return drafter.norm(h), out_kv

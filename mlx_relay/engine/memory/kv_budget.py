"""What the device can hold for the rows' caches, and which rows fit (GPU thread: made by
`EngineCore` at boot from MLX's counters, asked by its `Scheduler` each step and by the service
through `ModelInfo.memory_tokens`; `KVBudget` itself is arithmetic only).

    available = limit - weights - prefix cache budget - a prefill chunk's working set

- `limit`: what MLX may hold (`--memory-limit-gb`, else the device's memory, or the machine's RAM
  on the CPU backend); `weights`: what the loaded model holds (MLX's active memory after the
  load); the prefix cache's byte budget (its snapshots are held beside the rows); the working set
  of one prefill chunk (`working_set_bytes`: its attention block's scores, the experts dequantized
  for the grouped GEMMs, the chunk's activations), reserved so that no chunk runs the device out
  of memory.
- A row's caches: every attention layer's keys and values per token of its context (`per_token`)
  and every recurrent layer's conv window and state whatever its length (`per_row`), from the
  checkpoint's config (`models/footprint.py`, the MTP head's attention layer added).
- Rows decode in batches whose keys are left-padded to the longest row and whose row count is
  padded to a few sizes (`decode_state.batch_bucket`), so a batch holds bucket(rows) x (per_row +
  longest x per_token), not the sum of its rows: that is what `fits` counts, every running row
  reserved at its prompt plus its `max_tokens`. A row that does not fit beside the running ones
  waits (first come, first served) until rows end; a row that cannot fit even alone is refused by
  the service before anything runs (`memory_tokens`: a 400 naming the limit).

`plan` also bounds the prefill's working set from what the device leaves: one attention block's
scores (`PrefillOptions.attention_bytes`) are at most an eighth of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec

from mlx_relay.config import EngineConfig
from mlx_relay.engine.lanes.decode_state import batch_bucket
from mlx_relay.engine.models.checkpoint import read_config
from mlx_relay.engine.models.footprint import cache_shape, with_kv_bits
from mlx_relay.engine.models.loader import device_memory_bytes, prefix_cache_budget
from mlx_relay.engine.models.prefill_options import PrefillExperts, PrefillOptions, prefill_experts


class KVBudget(msgspec.Struct, frozen=True):
    limit: int
    weights: int
    prefix_cache: int
    working_set: int
    per_token: int
    per_row: int

    @property
    def available(self) -> int:
        """Bytes the rows' caches may hold, all of them together."""
        return max(0, self.limit - self.weights - self.prefix_cache - self.working_set)

    def batch_bytes(self, rows: int, longest: int) -> int:
        """A decode batch of `rows` rows, the longest holding `longest` tokens."""
        return batch_bucket(max(1, rows)) * (self.per_row + longest * self.per_token)

    @property
    def memory_tokens(self) -> int:
        """The most tokens (prompt and reply) one row's caches can hold, alone."""
        return max(0, (self.available - self.per_row) // max(1, self.per_token))

    def fits(self, reserved: Iterable[int]) -> bool:
        """Whether rows reserved at these lengths (tokens each) fit together."""
        lengths = list(reserved)
        return not lengths or self.batch_bytes(len(lengths), max(lengths)) <= self.available


#: Layers of a prefill chunk alive at once (`models/qwen3_5/prefill.py` queues one ahead)
LAYERS_IN_FLIGHT = 2


def working_set_bytes(*, chunk_tokens: int, hidden: int, attention_bytes: int, expert_bytes: int,
                      itemsize: int) -> int:
    """One prefill chunk's transient memory beyond the caches, for `LAYERS_IN_FLIGHT` layers: one
    attention block's scores (at most `attention_bytes`; attention layers are never adjacent in
    the family served), the experts of a layer's three projections dequantized for the grouped
    GEMMs (`expert_bytes` each) and the layer's activations (a generous 64 hidden widths a
    token: the mixers' projections, the routed rows, the residual stream)."""
    per_layer = 3 * expert_bytes + chunk_tokens * hidden * itemsize * 64
    return attention_bytes + LAYERS_IN_FLIGHT * per_layer


#: Share of what the weights and the prefix cache leave that one attention block's scores may take,
#: and its bounds: the block never under 256 MiB (the chunk would crawl), never over 8 GiB.
ATTENTION_SHARE = 8
ATTENTION_BYTES = (256 << 20, 8 << 30)


def plan(model_config: dict[str, Any], *, limit: int, weights: int, prefix_cache: int, chunk_tokens: int,
         experts: PrefillExperts, mtp_head: bool, kv_bits: int | None = None,
         compiled_chunk_tokens: int | None = None) -> tuple[KVBudget, PrefillOptions]:
    """The budget and the prefill's options for a model (its checkpoint's config) on a device
    that may hold `limit` bytes, `weights` of them the model's, its experts run as `experts` says
    (`PrefillOptions.with_experts`; "dequantize" holds a projection's experts in float while a
    layer runs; `kv_bits`: its attention keys and values kept quantized, the MTP head's not;
    `compiled_chunk_tokens`: `PrefillOptions.compiled_max_tokens`)."""
    text = model_config.get("text_config", model_config)
    shape = with_kv_bits(cache_shape(model_config), model_config, kv_bits)
    itemsize = 4 if str(text.get("dtype") or text.get("torch_dtype") or "") == "float32" else 2
    heads, kv_heads = int(text.get("num_attention_heads", 1)), int(text.get("num_key_value_heads", 1))
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // max(heads, 1))
    per_token = shape.per_token + (2 * kv_heads * head_dim * itemsize if mtp_head else 0)
    hidden = int(text.get("hidden_size", 0))
    quant = model_config.get("quantization") or {}
    kernel_fits = quant.get("bits") == 8 and quant.get("group_size") == 64  # else the kernel's fallback dequantizes
    dequantized = experts == "dequantize" or (experts in ("kernel", "narrow") and not kernel_fits)
    routed = int(text.get("num_experts", 0) or 0) if dequantized else 0
    expert_bytes = routed * int(text.get("moe_intermediate_size", 0) or 0) * hidden * 2
    low, high = ATTENTION_BYTES
    options = PrefillOptions(attention_bytes=min(high, max(low, (limit - weights - prefix_cache) // ATTENTION_SHARE)),
                             compiled_max_tokens=compiled_chunk_tokens)
    options = options.with_experts(experts)
    working = working_set_bytes(chunk_tokens=chunk_tokens, hidden=hidden, attention_bytes=options.attention_bytes,
                                expert_bytes=expert_bytes, itemsize=itemsize)
    budget = KVBudget(limit=limit, weights=weights, prefix_cache=prefix_cache, working_set=working,
                      per_token=per_token, per_row=shape.per_row)
    return budget, options


#: What MLX may hold when no `--memory-limit-gb` says: this share of the device's memory (the rest:
#: the CUDA context, cuBLAS and cuDNN workspaces, other processes' few hundred MB).
DEVICE_SHARE = 0.95


def engine_plan(loaded: Any, config: EngineConfig, *, prefix_cache: bool, chunk_tokens: int
                ) -> tuple[KVBudget, PrefillOptions]:
    """`plan` for the engine's model as loaded now (runs on the GPU thread: it asks MLX)."""
    info = loaded.info
    limit = config.memory_limit_bytes or int(device_memory_bytes()[0] * DEVICE_SHARE)
    return plan(read_config(Path(info.model_path)), limit=limit, weights=mx.get_active_memory(),
                prefix_cache=prefix_cache_budget(config) if prefix_cache else 0, chunk_tokens=chunk_tokens,
                experts=prefill_experts(config.prefill_experts, info.backend), mtp_head=config.mtp and info.has_mtp,
                kv_bits=config.kv_bits, compiled_chunk_tokens=config.compiled_chunk_tokens)


def with_held_weights(budget: KVBudget) -> KVBudget:
    """`budget` with what the model holds now (after its lanes loaded their parts: an MTP head)."""
    return msgspec.structs.replace(budget, weights=mx.get_active_memory())

"""An embedding model (GPU thread only): a checkpoint loaded by mlx-embeddings, its forward over a
batch of token-id inputs, one normalized vector each (issue 47.1; the engine's `/v1/embeddings`).

    embedder = Embedder.load(path)                  # mlx_embeddings.utils.load, the checkpoint's pooling
    vectors = embedder.embed([[ids...], [ids...]])  # numpy float32 [inputs, dims], each of norm 1

The library runs the model and its pooling (Qwen3-Embedding's last token, BERT-style models' mean
over the tokens) and normalizes; this wraps it for the engine: inputs of different lengths are
padded on the right to the batch's longest with the tokenizer's pad id and an attention mask (so a
vector does not depend on what it was batched with: `tests/test_embeddings.py` pins each against
the library's call on the input alone, float32), and the checkpoint's declared pooling
(`checkpoint.embedding_pooling`) is checked against the one the library runs for its model type.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_relay.config import EngineConfig
from mlx_relay.engine.models.checkpoint import context_length, embedding_pooling, read_config
from mlx_relay.engine.models.loader import device_memory_bytes
from mlx_relay.errors import ModelLoadError
from mlx_relay.messages.gpu import EmbeddingInfo

#: what mlx-embeddings pools for a model type (its `models/<type>.py`), where the engine serves it
LIBRARY_POOLING = {"qwen3": "lasttoken"}
#: the attention scores' bytes a batch may hold (of the device's memory, or the RAM on a CPU): the
#: library's attention materializes heads x T x T float32 scores an input, about three copies
SCORES_SHARE = 0.05
SCORE_BYTES = 4 * 3


class Embedder:
    """One loaded embedding model: `embed` a batch of inputs (token ids) to unit vectors."""

    def __init__(self, model: Any, *, pad_id: int, dims: int, context: int, model_type: str, pooling: str,
                 vocab_size: int, heads: int, scores_bytes: int) -> None:
        self._model = model
        self.vocab_size = vocab_size
        self.heads, self.scores_bytes = heads, scores_bytes
        # an input's tokens within the checkpoint's context and what its scores may hold in memory
        context = min(context, math.isqrt(scores_bytes // (heads * SCORE_BYTES)))
        self.pooling = pooling
        self.pad_id = pad_id
        self.dims = dims
        self.context = context
        self.model_type = model_type

    @classmethod
    def load(cls, path: Path, scores_bytes: int | None = None) -> Embedder:
        """Load `path` through mlx-embeddings (on the calling thread: the GPU thread); a
        `ModelLoadError` when it is no embedding checkpoint of a model type served here.
        `scores_bytes`: what a batch's attention scores may hold (default `SCORES_SHARE` of the
        device's memory), which bounds an input's tokens (`context`) and a batch's rows."""
        from mlx_embeddings.utils import load

        pooling = embedding_pooling(path)
        config = read_config(path)
        model_type = str(config.get("model_type", ""))
        if pooling is None:
            raise ModelLoadError(f"{path} is not an embedding model (no sentence-transformers modules.json "
                                 "with a Pooling module)")
        if LIBRARY_POOLING.get(model_type) != pooling:
            raise ModelLoadError(f"embedding models of type {model_type!r} with {pooling} pooling are not served "
                                 f"(served: {', '.join(f'{t} with {p} pooling' for t, p in LIBRARY_POOLING.items())})")
        model, tokenizer = load(str(path))
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None) or 0
        if scores_bytes is None:
            scores_bytes = int(device_memory_bytes()[0] * SCORES_SHARE)
        return cls(model, pad_id=int(pad), dims=int(config["hidden_size"]), context=context_length(config),
                   model_type=model_type, pooling=pooling, vocab_size=int(config["vocab_size"]),
                   heads=int(config["num_attention_heads"]), scores_bytes=scores_bytes)

    def max_rows(self, longest: int) -> int:
        """The most inputs of `longest` tokens a batch may hold within `scores_bytes` (at least one)."""
        return max(1, self.scores_bytes // (self.heads * SCORE_BYTES * longest * longest))

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One unit vector per input (each a non-empty list of token ids within the context), float32
        [len(inputs), dims]; the inputs run as one batch, right-padded."""
        longest = max(len(ids) for ids in inputs)
        ids = np.full((len(inputs), longest), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(inputs), longest), dtype=np.int32)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        out = self._model(mx.array(ids), attention_mask=mx.array(mask)).text_embeds
        return np.array(out.astype(mx.float32))

    def info(self, config: EngineConfig) -> EmbeddingInfo:
        """What the front end knows of it (`ModelInfo.embedding`)."""
        return EmbeddingInfo(config.embedding_names[0], str(config.embedding_model), self.model_type, self.pooling,
                             self.dims, self.context, self.vocab_size)

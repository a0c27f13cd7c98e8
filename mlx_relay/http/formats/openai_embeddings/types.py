"""OpenAI Embeddings wire types (msgspec) and the answer built from an `EmbeddingResult`: each
vector as floats or, `encoding_format: "base64"` (what OpenAI's Python SDK asks by default), the
base64 of its little-endian float32 bytes; `dimensions` keeps the first N of each vector and scales
it back to unit length (Matryoshka truncation, as OpenAI's `text-embedding-3` models)."""

from __future__ import annotations

import base64
from typing import Literal

import msgspec
import numpy as np

from mlx_relay.errors import InvalidRequest


class EmbeddingRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    input: str | list[str | int | list[int]]  # a text, texts, token ids, or token-id lists (checked below)
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingItem(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


def inputs_of(body: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The request's inputs as texts or token-id lists (a bare string or a flat id list is one input)."""
    raw = body.input
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(x, int) for x in raw):
        return [[int(x) for x in raw]]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in raw):
        return [str(x) for x in raw]
    if all(isinstance(x, list) for x in raw):
        return [list(x) for x in raw]  # type: ignore[arg-type]
    raise InvalidRequest("'input' mixes texts and token ids", param="input")


def check_dimensions(dimensions: int | None, dims: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= dims:
        raise InvalidRequest(f"'dimensions' must be in [1, {dims}] for this model", param="dimensions")


def truncated(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """`vectors` cut to `dimensions` (checked: `check_dimensions`) and renormalized (None: as they are)."""
    if dimensions is None or dimensions == vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)


def answer(vectors: np.ndarray, body: EmbeddingRequest, model: str, prompt_tokens: int) -> EmbeddingList:
    data = [EmbeddingItem(i, base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
                          else v.astype(np.float32).tolist())
            for i, v in enumerate(vectors)]
    return EmbeddingList(data, model, EmbeddingUsage(prompt_tokens, prompt_tokens))

"""Embeddings on the front end (issue 47.1): what `/v1/embeddings` asks of a model whose engine holds
an embedding model beside its chat model (`--embedding-model`; `engine/embeddings/embedder.py`).

    service = EmbeddingService(gpu, info)            # ChatService.embeddings, where the engine has one
    result = await service.embed(["text", ...])      # or token-id lists: EmbeddingResult

The inputs are tokenized here (the embedding checkpoint's own tokenizer, through transformers: the
front end never loads MLX), checked (none empty, none past the embedding model's context, at most
`MAX_INPUTS`), and sent to the GPUExecutor as one `Embed` stream (past `MAX_WAITING` requests in
the engine at once, a 429). The engine runs them a batch a step within the step's prefill share
(`engine/embeddings/jobs.py`), so decode priority holds them to their share of the time beside
decoding rows as it holds a long prompt's chunks.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import anyio
import msgspec
import numpy as np

from mlx_relay.errors import InvalidRequest, Overloaded, PromptTooLong
from mlx_relay.messages.gpu import Embed, EmbeddedVectors, EmbeddingInfo
from mlx_relay.runtime import ActorRef

MAX_INPUTS = 2048  # OpenAI's limit on `input`'s items
MAX_WAITING = 64  # embedding requests in the engine at once, past which a 429


class EmbeddingResult(msgspec.Struct, frozen=True):
    vectors: Any  # numpy float32 [inputs, dims], unit rows
    prompt_tokens: int


class EmbeddingService:
    """One chat model's embedding model, as the routes use it."""

    def __init__(self, gpu: ActorRef, info: EmbeddingInfo) -> None:
        self.gpu = gpu
        self.info = info
        self._waiting = 0  # requests in the engine

    @cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.info.model_path)

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        tok = await anyio.to_thread.run_sync(lambda: self.tokenizer)
        return [list(tok(text)["input_ids"]) for text in texts]

    def check(self, inputs: list[list[int]]) -> None:
        """Every input non-empty and within the context (`PromptTooLong` names the first that is not)."""
        if not inputs:
            raise InvalidRequest("'input' must not be empty", param="input")
        if len(inputs) > MAX_INPUTS:
            raise InvalidRequest(f"'input' has {len(inputs)} items; at most {MAX_INPUTS} are allowed", param="input")
        limit = self.info.context_length
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequest(f"input {i} is empty", param="input")
            if len(ids) > limit:
                raise PromptTooLong(f"input {i} has {len(ids)} tokens; this embedding model's maximum context "
                                    f"length is {limit} tokens", prompt_tokens=len(ids), limit=limit, param="input")

    async def embed(self, inputs: list[str] | list[list[int]]) -> EmbeddingResult:
        """The unit vectors of `inputs` (texts, or token-id lists each within the vocabulary)."""
        ids = await self.tokenize(inputs) if inputs and isinstance(inputs[0], str) else inputs  # type: ignore[arg-type]
        ids = [list(x) for x in ids]  # type: ignore[arg-type]
        self.check(ids)
        vocab = self.info.vocab_size
        for i, row in enumerate(ids):
            if any(not 0 <= t < vocab for t in row):
                raise InvalidRequest(f"input {i} has token ids outside [0, {vocab})", param="input")
        if self._waiting >= MAX_WAITING:
            raise Overloaded(f"{self._waiting} embedding requests are running; retry later")
        self._waiting += 1
        try:
            async with self.gpu.stream(Embed(ids)) as events:
                got = None
                async for event in events:  # the stream's one item
                    got = event
        finally:
            self._waiting -= 1
        assert isinstance(got, EmbeddedVectors)
        out = np.frombuffer(got.vectors, dtype="<f4").reshape(len(ids), got.dims)
        return EmbeddingResult(vectors=out, prompt_tokens=sum(len(x) for x in ids))

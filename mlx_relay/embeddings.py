"""Embeddings on the front end (issue 47.1): what `/v1/embeddings` asks of a model whose engine holds
an embedding model beside its chat model (`--embedding-model`; `engine/embeddings/embedder.py`).

    service = EmbeddingService(gpu, info)            # ChatService.embeddings, where the engine has one
    result = await service.embed(["text", ...])      # or token-id lists: EmbeddingResult

The inputs are tokenized here (the embedding checkpoint's own tokenizer, through transformers: the
front end never loads MLX), checked (none empty, none past the embedding model's context, at most
`MAX_INPUTS`), and sent to the GPUExecutor as `EmbedInputs` commands of at most `BATCH_TOKENS`
tokens each (padding counted). One batch of a model's is in flight at a time (requests take turns,
first come first served; past `MAX_WAITING` waiting, a 429): the engine runs commands between two
of its steps, so a decoding stream waits on about one such batch a step, as it waits on a bounded
prefill chunk.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import anyio
import msgspec
import numpy as np

from mlx_relay.engine.protocol import EmbedInputs
from mlx_relay.errors import InvalidRequest, Overloaded, PromptTooLong
from mlx_relay.messages.gpu import EmbeddedVectors, EmbeddingInfo
from mlx_relay.runtime import ActorRef

MAX_INPUTS = 2048  # OpenAI's limit on `input`'s items
BATCH_TOKENS = 8192  # tokens (padding included) of one engine command
MAX_WAITING = 64  # embedding requests waiting for their turn, past which a 429


class EmbeddingResult(msgspec.Struct, frozen=True):
    vectors: Any  # numpy float32 [inputs, dims], unit rows
    prompt_tokens: int


def batches(lengths: list[int], budget: int) -> list[list[int]]:
    """The inputs' indices in batches whose padded size (rows x the longest) stays within `budget`
    (an input alone may exceed it), longest first so that each batch pads little."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class EmbeddingService:
    """One chat model's embedding model, as the routes use it."""

    def __init__(self, gpu: ActorRef, info: EmbeddingInfo) -> None:
        self.gpu = gpu
        self.info = info
        self._turn = anyio.Lock()  # one batch in flight (anyio's lock is first come, first served)
        self._waiting = 0

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
            raise Overloaded(f"{self._waiting} embedding requests are waiting; retry later")
        out = np.zeros((len(ids), self.info.dims), dtype=np.float32)
        for batch in batches([len(x) for x in ids], BATCH_TOKENS):
            self._waiting += 1
            try:
                async with self._turn:
                    got: EmbeddedVectors = await self.gpu.ask(EmbedInputs([ids[i] for i in batch]))
            finally:
                self._waiting -= 1
            out[batch] = np.frombuffer(got.vectors, dtype="<f4").reshape(len(batch), got.dims)
        return EmbeddingResult(vectors=out, prompt_tokens=sum(len(x) for x in ids))

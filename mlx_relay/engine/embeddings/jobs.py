"""The engine's embedding requests (GPU thread only): queued as `AddEmbedding` commands, run a batch
a step within the step's prefill share, so decode priority (`step/interleave.py`) holds them to
their share of the time beside decoding rows as it holds prompts' prefill chunks.

    jobs = EmbeddingJobs(embedder)
    jobs.add(rid, inputs)                      # AddEmbedding
    tokens, done = jobs.run(share)             # in a step: [(rid, EmbeddedVectors)] of the finished jobs

First come, first served: a step runs the oldest job's next inputs, longest first, as many as its
share holds padded (rows x the longest) and the embedder's memory bound allows (`Embedder.max_rows`);
an input longer than the share runs alone once the step has any share (an input cannot be cut). A
job's vectors go out when its last input has run; a batch that fails (the library raised) fails its
job, never the engine.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mlx_relay.engine.embeddings.embedder import Embedder
from mlx_relay.errors import EmbeddingsUnavailable, GenerationFailed
from mlx_relay.messages.gpu import EmbeddedVectors
from mlx_relay.runtime.supervision import is_failure

log = logging.getLogger(__name__)


@dataclass
class _Job:
    inputs: list[list[int]]
    order: list[int]  # input indices, longest first, not run yet
    vectors: np.ndarray  # [inputs, dims], filled as the batches run


class EmbeddingJobs:
    """An engine's embedding requests (`embedder` None: it holds no embedding model, and refuses them)."""

    def __init__(self, embedder: Embedder | None) -> None:
        self.embedder = embedder
        self._jobs: OrderedDict[int, _Job] = OrderedDict()

    @property
    def has_work(self) -> bool:
        return bool(self._jobs)

    def add(self, rid: int, inputs: list[list[int]]) -> None:
        if self.embedder is None:
            raise EmbeddingsUnavailable("this engine holds no embedding model")
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        self._jobs[rid] = _Job(inputs, order, np.zeros((len(inputs), self.embedder.dims), dtype=np.float32))

    def cancel(self, rid: int) -> None:
        self._jobs.pop(rid, None)

    def run(self, share: int) -> tuple[int, list[tuple[int, EmbeddedVectors | GenerationFailed]]]:
        """One batch of the oldest job within `share` tokens (none at 0) and the embedder's
        `max_rows`: the padded tokens it ran and the jobs it finished (or failed)."""
        if share <= 0 or not self._jobs or self.embedder is None:
            return 0, []
        rid, job = next(iter(self._jobs.items()))
        longest = len(job.inputs[job.order[0]])
        take = max(1, min(len(job.order), share // longest, self.embedder.max_rows(longest)))
        batch, job.order = job.order[:take], job.order[take:]
        try:
            job.vectors[batch] = self.embedder.embed([job.inputs[i] for i in batch])
        except BaseException as exc:
            if not is_failure(exc):  # native panics are failures too; control flow is not
                raise
            log.exception("an embedding batch failed; failing its request")
            del self._jobs[rid]
            return 0, [(rid, GenerationFailed("the embedding batch failed"))]
        if job.order:
            return take * longest, []
        del self._jobs[rid]
        return take * longest, [(rid, EmbeddedVectors(self.embedder.dims, job.vectors.astype("<f4").tobytes()))]

"""The engine's embedding requests (GPU thread only): queued as `AddEmbedding` commands, run a batch
a step within the step's prefill share, so decode priority (`step/interleave.py`) holds them to
their share of the time beside decoding rows as it holds prompts' prefill chunks.

    jobs = EmbeddingJobs(embedder)
    jobs.add(rid, inputs)                      # AddEmbedding
    tokens, done = jobs.run(share)             # in a step: [(rid, EmbeddedVectors)] of the finished jobs

First come, first served: a step runs the oldest job's next inputs, longest first, as many as its
share holds padded (rows x the longest); an input longer than the share runs alone once the step
has any share (an input cannot be cut). A job's vectors go out when its last input has run.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from mlx_relay.engine.embeddings.embedder import Embedder
from mlx_relay.errors import EmbeddingsUnavailable
from mlx_relay.messages.gpu import EmbeddedVectors


@dataclass
class _Job:
    inputs: list[list[int]]
    order: list[int]  # input indices, longest first, not run yet
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))


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

    def run(self, share: int) -> tuple[int, list[tuple[int, EmbeddedVectors]]]:
        """One batch of the oldest job within `share` tokens (none at 0): the padded tokens it ran
        and the jobs it finished."""
        if share <= 0 or not self._jobs or self.embedder is None:
            return 0, []
        rid, job = next(iter(self._jobs.items()))
        longest = len(job.inputs[job.order[0]])
        take = max(1, min(len(job.order), share // longest))
        batch, job.order = job.order[:take], job.order[take:]
        job.vectors[batch] = self.embedder.embed([job.inputs[i] for i in batch])
        if job.order:
            return take * longest, []
        del self._jobs[rid]
        return take * longest, [(rid, EmbeddedVectors(self.embedder.dims, job.vectors.astype("<f4").tobytes()))]

"""The driver interface: what the runner needs from a target, whatever carries the requests.

Two implementations: `mlx_relay.bench.client.HttpDriver` (any OpenAI-compatible URL, streamed
over HTTP) and `mlx_relay.bench.inprocess.InProcessDriver` (a `Relay` in this process, no HTTP).
`send` never raises for a failed request: the failure is in the returned measurement.
"""

from __future__ import annotations

from typing import Protocol

from mlx_relay.bench.records import Outcome
from mlx_relay.bench.workload import BenchRequest


class Driver(Protocol):
    label: str  # short name in tables and plots ("A", "ours", "127.0.0.1:8000")
    description: str  # what it drives (a URL, "in-process MODEL")
    model: str | None  # the model name sent or served

    async def send(self, request: BenchRequest) -> Outcome:
        """Send one request, read its whole answer, measure it."""
        ...

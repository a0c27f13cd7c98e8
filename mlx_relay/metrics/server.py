"""`ServerMetrics`: one server's registry and its exposition (what `GET /metrics` answers).

The registry is the server's own (never prometheus-client's global one) and holds the
request-path series; each scrape adds a `StatsCollector` over the snapshot it gathered, and both
are exposed together in the Prometheus text format.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from mlx_relay.metrics.requests import RequestMetrics
from mlx_relay.metrics.stats import StatsCollector, StatsSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST  # text/plain; version=0.0.4


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.requests = RequestMetrics(model_name, self.registry)

    def render(self, snapshot: StatsSnapshot) -> bytes:
        """The exposition of the request-path series and `snapshot`."""
        return generate_latest(_Scrape(self.registry, StatsCollector(snapshot, self.model_name)))


class _Scrape(Collector):
    """The server's registry and one scrape's stats, as one collector."""

    def __init__(self, registry: CollectorRegistry, stats: StatsCollector) -> None:
        self.registry = registry
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        yield from self.stats.collect()

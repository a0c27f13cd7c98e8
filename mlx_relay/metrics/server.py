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

    def collector(self, snapshot: StatsSnapshot | None) -> Collector:
        """The request-path series and `snapshot`'s (None: the request path's alone, e.g. a pooled
        model that is not loaded now), as one collector."""
        stats = [StatsCollector(snapshot, self.model_name)] if snapshot is not None else []
        return MergedCollector([self.registry, *stats])

    def render(self, snapshot: StatsSnapshot) -> bytes:
        """The exposition of the request-path series and `snapshot`."""
        return generate_latest(self.collector(snapshot))


class MergedCollector(Collector):
    """Several collectors' families as one exposition: families of one name (the same series of
    several models) become one family holding every sample, so each `# TYPE` line appears once."""

    def __init__(self, collectors: list[Collector]) -> None:
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for collector in self.collectors:
            for family in collector.collect():
                if (held := families.get(family.name)) is None:
                    families[family.name] = family
                else:
                    held.samples.extend(family.samples)
        yield from families.values()

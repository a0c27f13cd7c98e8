"""Prometheus metrics of one server (`GET /metrics`), through prometheus-client.

Two sources, one exposition (`ServerMetrics.render`):

- the request path (`requests.RequestMetrics`): `ChatService` observes each request as it goes
  (queue wait, first token, each later token, its end) into the server's own registry;
- the actors' own counters (`stats.StatsCollector`): at scrape time the Relay asks every actor for
  the stats it keeps already (`gather.gather_stats`: Admission, the GPUExecutor, the
  PrefixCacheStore, the TextMTPExecutor, the VisionExecutor, the SpecPrefillScorer) and the
  collector turns that one snapshot into metric families.

Names follow vLLM's where one exists (`vllm:num_requests_running` is `mlx_relay:num_requests_running`),
every series carries the served model as `model_name`. Nothing is module-level state: each Relay
builds its own registry, so two servers in one process never share a series.
"""

from __future__ import annotations

from mlx_relay.metrics.requests import PREFIX, RequestClock, RequestMetrics
from mlx_relay.metrics.server import CONTENT_TYPE, ServerMetrics
from mlx_relay.metrics.stats import StatsCollector, StatsSnapshot

__all__ = ["CONTENT_TYPE", "PREFIX", "RequestClock", "RequestMetrics", "ServerMetrics", "StatsCollector",
           "StatsSnapshot"]

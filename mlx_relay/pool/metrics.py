"""The model pool's own series, beside every model's (each labelled by `model_name`):

    model_loads_total, model_load_failures_total, model_load_seconds     per model
    model_unloads_total{reason}     request (POST unload), budget, idle, failed, shutdown
    model_evictions_total{reason}   the unloads the pool chose: budget (room for another), idle (its TTL)
    model_state{state}, model_memory_reserved_bytes                       per model, at scrape time
    memory_budget_bytes, memory_reserved_bytes, memory_reserved_peak_bytes   the pool's

`memory_reserved_peak_bytes` is the most the models whose engines were running reserved at once:
never above the budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_relay.metrics import PREFIX
from mlx_relay.pool.slot import ModelSlot, ModelState

LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STATES: tuple[ModelState, ...] = ("unloaded", "loading", "ready", "unloading", "failed")


class PoolMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        model = ("model_name",)
        self.loads = Counter(PREFIX + "model_loads", "Model loads started", model, registry=self.registry)
        self.load_failures = Counter(PREFIX + "model_load_failures", "Model loads that failed", model,
                                     registry=self.registry)
        self.load_seconds = Histogram(PREFIX + "model_load_seconds", "From a load's start to the model ready "
                                      "(waiting for room excluded)", model, buckets=LOAD_BUCKETS,
                                      registry=self.registry)
        self.unloads = Counter(PREFIX + "model_unloads", "Models unloaded, by reason", ("model_name", "reason"),
                               registry=self.registry)
        self.evictions = Counter(PREFIX + "model_evictions", "Models the pool unloaded on its own, by reason "
                                 "(budget: room for another model; idle: its idle TTL)", ("model_name", "reason"),
                                 registry=self.registry)

    def collector(self, slots: Sequence[ModelSlot], budget: int | None, peak: int) -> Collector:
        return _PoolScrape(self.registry, slots, budget, peak)


class _PoolScrape(Collector):
    def __init__(self, registry: CollectorRegistry, slots: Sequence[ModelSlot], budget: int | None, peak: int) -> None:
        self.registry, self.slots, self.budget, self.peak = registry, slots, budget, peak

    def collect(self) -> Iterator[Metric]:
        yield from self.registry.collect()
        state = GaugeMetricFamily(PREFIX + "model_state", "1 for each model's state", labels=["model_name", "state"])
        reserved = GaugeMetricFamily(PREFIX + "model_memory_reserved_bytes", "What a model is counted for against "
                                     "the budget while loading, loaded or unloading", labels=["model_name"])
        for slot in self.slots:
            for name in STATES:
                state.add_metric([slot.name, name], float(slot.state == name))
            reserved.add_metric([slot.name], slot.reserved)
        yield state
        yield reserved
        if self.budget is not None:
            yield GaugeMetricFamily(PREFIX + "memory_budget_bytes", "The models' memory budget", value=self.budget)
        yield GaugeMetricFamily(PREFIX + "memory_reserved_bytes", "Reserved by the models loading, loaded or "
                                "unloading", value=sum(slot.reserved for slot in self.slots))
        yield GaugeMetricFamily(PREFIX + "memory_reserved_peak_bytes", "The most the models whose engines ran "
                                "reserved at once", value=self.peak)

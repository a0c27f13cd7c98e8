"""The actors' own counters as metric families: `StatsSnapshot` is what one scrape gathered
(`gather.gather_stats`), `StatsCollector` a prometheus-client custom collector that turns it into
families at exposition time. A part the scrape could not get (the model still loading, an actor
restarting) is None and its families are left out of that scrape; everything else is reported.

    Admission         num_requests_running, num_requests_waiting, admission_rejections_total{reason},
                      server_state{state}
    GPUExecutor       gpu_memory_bytes{kind}, gpu_memory_peak_bytes, prefix_cache_snapshot_bytes{tier},
                      prefix_cache_snapshots{tier}
    PrefixCacheStore  prefix_cache_budget_bytes, prefix_cache_evictions_total, prefix_cache_superseded_total
    TextMTPExecutor   spec_decode_num_draft_tokens_total{source}, spec_decode_num_accepted_tokens_total{source}
                      (source: mtp, the head's drafts; context, drafts copied from the request's context),
                      mtp_requests_total{decision}, context_draft_requests_total
    SpecPrefillScorer specprefill_runs_total, specprefill_fallbacks_total, specprefill_tokens_scored_total,
                      specprefill_tokens_kept_total, specprefill_chunks_anchored_total,
                      specprefill_anchors_rescued_total, specprefill_anchors_dropped_total
    VisionExecutor    vision_cache_queries_total, vision_cache_hits_total, vision_cache_bytes
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_relay.messages.admission import AdmissionStats
from mlx_relay.messages.gpu import EngineStats
from mlx_relay.messages.prefix_cache import PrefixStats
from mlx_relay.messages.specprefill import SpecPrefillStats
from mlx_relay.messages.text_mtp import MTPStats
from mlx_relay.messages.vision import VisionStats
from mlx_relay.metrics.requests import PREFIX

STATES = ("loading", "warming", "ready", "degraded", "draining", "failed")  # `Relay.health()`'s


class StatsSnapshot(msgspec.Struct, frozen=True):
    status: str  # `Relay.health().status`
    admission: AdmissionStats
    engine: EngineStats | None = None
    prefix: PrefixStats | None = None
    mtp: MTPStats | None = None
    vision: VisionStats | None = None
    specprefill: SpecPrefillStats | None = None


class StatsCollector(Collector):
    """One scrape's snapshot as metric families (each series labelled with `model_name`)."""

    def __init__(self, snapshot: StatsSnapshot, model_name: str) -> None:
        self.snapshot = snapshot
        self.model = model_name

    def _gauge(self, name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
        family.add_metric([self.model, *labels.values()], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model], value)
        return family

    def _by(self, family: GaugeMetricFamily | CounterMetricFamily, values: dict[str, float]
            ) -> GaugeMetricFamily | CounterMetricFamily:
        for label, value in values.items():
            family.add_metric([self.model, label], value)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        yield from self._admission(s.status, s.admission)
        if s.engine is not None:
            yield from self._engine(s.engine)
        if s.prefix is not None:
            yield self._gauge("prefix_cache_budget_bytes", "The prefix cache's byte budget", s.prefix.budget_bytes)
            yield self._counter("prefix_cache_evictions", "Prefix-cache snapshots evicted", s.prefix.evictions)
            yield self._counter("prefix_cache_superseded", "Prefix-cache snapshots freed because their "
                                "conversation moved past them", s.prefix.superseded)
        if s.mtp is not None:
            yield from self._mtp(s.mtp)
        if s.specprefill is not None:
            yield from self._specprefill(s.specprefill)
        if s.vision is not None:
            v = s.vision
            yield self._counter("vision_cache_queries", "Images looked up in the vision feature cache",
                                v.hits + v.misses)
            yield self._counter("vision_cache_hits", "Images whose encoded features were reused", v.hits)
            yield self._gauge("vision_cache_bytes", "Encoded image features held", v.bytes)

    def _admission(self, status: str, a: AdmissionStats) -> Iterator[Metric]:
        yield self._gauge("num_requests_running", "Requests holding a slot (admitted, generating)", a.running)
        yield self._gauge("num_requests_waiting", "Requests queued for a slot", a.queued)
        yield self._by(CounterMetricFamily(PREFIX + "admission_rejections", "Requests refused before they ran, "
                                           "by reason", labels=["model_name", "reason"]),
                       {reason: float(n) for reason, n in a.rejected.items()})
        yield self._by(GaugeMetricFamily(PREFIX + "server_state", "1 for the state /health reports",
                                         labels=["model_name", "state"]),
                       {state: float(state == status) for state in STATES})

    def _engine(self, e: EngineStats) -> Iterator[Metric]:
        yield self._by(GaugeMetricFamily(PREFIX + "gpu_memory_bytes", "MLX's device memory: in arrays (active), "
                                         "freed but kept for reuse (cache); on CUDA the driver's pool under "
                                         "it: reserved from the device, handed out (cuda_pool_*)",
                                         labels=["model_name", "kind"]),
                       {"active": e.active_memory_bytes, "cache": e.cache_memory_bytes,
                        **({"cuda_pool_reserved": e.cuda_pool_reserved_bytes,
                            "cuda_pool_used": e.cuda_pool_used_bytes}
                           if e.cuda_pool_reserved_bytes is not None and e.cuda_pool_used_bytes is not None else {})})
        yield self._gauge("gpu_memory_peak_bytes", "The most MLX held in arrays at once since start",
                          e.peak_memory_bytes)
        if e.cuda_pool_reserved_high_bytes is not None:
            yield self._gauge("cuda_pool_reserved_high_bytes", "The most the CUDA driver's memory pool under "
                              "MLX reserved at once since start", e.cuda_pool_reserved_high_bytes)
        if e.device_used_bytes is not None:
            yield self._gauge("device_memory_used_bytes", "The device's memory in use, every process on it",
                              e.device_used_bytes)
        yield self._gauge("prefix_cache_snapshot_bytes", "Bytes of prefix-cache snapshots held, by tier",
                          e.snapshot_bytes, tier="memory")
        yield self._gauge("prefix_cache_snapshots", "Prefix-cache snapshots held, by tier", e.snapshots,
                          tier="memory")

    def _mtp(self, m: MTPStats) -> Iterator[Metric]:
        sources = ("by source: mtp (the MTP head's), context (copied from the request's context) or draft (the "
                   "draft model's)")
        yield self._by(CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified "
                                           f"(finished requests), {sources}", labels=["model_name", "source"]),
                       {"mtp": m.drafted, "context": m.context_drafted, "draft": m.draft_drafted})
        yield self._by(CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted "
                                           f"(finished requests), {sources}", labels=["model_name", "source"]),
                       {"mtp": m.accepted, "context": m.context_accepted, "draft": m.draft_accepted})
        yield self._counter("context_draft_requests", "Text requests planned with drafts copied from their context",
                            m.context_planned)
        yield self._by(CounterMetricFamily(PREFIX + "mtp_requests", "Text requests by decode path: mtp (planned "
                                           "with MTP) or plain", labels=["model_name", "decision"]),
                       {"mtp": m.planned, "plain": m.declined})
        if m.round_cost is not None:  # measured by the warm-up (none without one)
            yield self._gauge("mtp_round_cost_steps", "An MTP round's time in plain decode steps, a lone row each way "
                              "(the warm-up's measure; under mtp_policy auto the head drafts only where a round can "
                              "pay for itself)", m.round_cost)

    def _specprefill(self, p: SpecPrefillStats) -> Iterator[Metric]:
        yield self._counter("specprefill_runs", "Requests prefilled sparsely by SpecPrefill", p.sparse_requests)
        yield self._counter("specprefill_fallbacks", "Requests due for SpecPrefill that were prefilled in full "
                            "(scoring failed)", p.fallbacks)
        yield self._counter("specprefill_tokens_scored", "Prompt tokens the draft model scored", p.tokens_scored)
        yield self._counter("specprefill_tokens_kept", "Scored prompt tokens kept for the prefill", p.tokens_kept)
        yield self._counter("specprefill_chunks_anchored", "Chunks kept ahead of the scores because they share a "
                            "run of tokens with the query", p.chunks_anchored)
        yield self._counter("specprefill_anchors_rescued", "Anchored chunks that the draft's scores alone would "
                            "have dropped", p.anchors_rescued)
        yield self._counter("specprefill_anchors_dropped", "Anchor chunks the keep budget had no room for",
                            p.anchors_dropped)

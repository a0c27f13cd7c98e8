"""`GET /v1/loads`: the worker-load document a router in front of several servers reads (SMG, the
SGLang Model Gateway, polls it on every worker it registered as a generic OpenAI-compatible backend:
`/v1/loads?include=core,disagg,queues,memory`, and it reads no `/metrics` for such a worker).

The schema is SMG's `WorkerLoadResponse`: one `SchedulerLoadSnapshot` per data-parallel rank (one
here). Its numbers come from Admission's counters (`AdmissionStats`), the same ones `/health` and
`/metrics` report, so the three cannot disagree:

    num_running_reqs      requests holding a slot             (/metrics: mlx_relay:num_requests_running)
    num_waiting_reqs      requests queued for a slot          (/metrics: mlx_relay:num_requests_waiting)
    max_running_requests  slots (--max-num-seqs)
    token_usage           0.0, not reported: this engine has no paged KV pool whose fill could be
                          (each sequence holds its own cache). SMG reads it as KV-cache fill: its
                          overload protection (on by default) leaves a worker out of routing at 0.8,
                          so the slot share reported here before took a replica with 13 of its 16
                          slots busy out of routing, and a session's next turn went to a replica
                          without its prefix (8 of 41 second turns uncached, agent_fleet c=32, two
                          replicas on a CPU; 41 of 41 with it 0: benchmarks/results/cluster-affinity-cpu-2026-11-28/)
    utilization           running / slots (the slot count is the capacity past which requests queue)

Sections in `include` other than `core` (disagg, queues, memory) are accepted and add nothing (SMG
reads absent fields as unset); an unknown section is a 400 in the OpenAI error shape.
"""

from __future__ import annotations

import time

import msgspec

from mlx_relay.errors import InvalidRequest
from mlx_relay.messages.admission import AdmissionStats

SECTIONS = frozenset({"core", "disagg", "queues", "memory"})


class SchedulerLoad(msgspec.Struct, frozen=True):
    """One rank's load (SMG's `SchedulerLoadSnapshot`)."""

    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    max_running_requests: int
    token_usage: float
    utilization: float
    num_waiting_uncached_tokens: int = 0  # not counted here (SMG: 0 means not reported)
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0  # 0: no absolute KV token capacity to report
    gen_throughput: float = 0.0
    cache_hit_rate: float = 0.0


class WorkerLoads(msgspec.Struct, frozen=True):
    """`GET /v1/loads` (SMG's `WorkerLoadResponse`)."""

    timestamp: str
    dp_rank_count: int
    loads: list[SchedulerLoad]


def parse_include(raw: str | None) -> frozenset[str]:
    """The `include` query parameter: comma-separated sections (default: core)."""
    if raw is None:
        return frozenset({"core"})
    asked = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = sorted(asked - SECTIONS)
    if unknown:
        raise InvalidRequest(f"unknown load section(s) {', '.join(map(repr, unknown))}; known: "
                             f"{', '.join(sorted(SECTIONS))}", param="include")
    return asked


def worker_loads(stats: AdmissionStats) -> WorkerLoads:
    """The load document from one read of Admission's counters."""
    slots = max(stats.max_num_seqs, 1)
    share = min(stats.running / slots, 1.0)
    load = SchedulerLoad(dp_rank=0, num_running_reqs=stats.running, num_waiting_reqs=stats.queued,
                         num_total_reqs=stats.running + stats.queued, max_running_requests=stats.max_num_seqs,
                         token_usage=0.0, utilization=share)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return WorkerLoads(timestamp=stamp, dp_rank_count=1, loads=[load])

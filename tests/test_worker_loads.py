"""`GET /v1/loads` as SMG reads it (`mlx_relay/http/loads.py`), from Admission's counters: the
request counts and the slot share as `utilization`; `token_usage` stays 0 (not reported: no paged KV
pool), because SMG's overload protection reads it as KV-cache fill and left a replica with 13 of its
16 slots busy out of routing, sending sessions' next turns to a replica without their prefix
(benchmarks/results/cluster-affinity-cpu-2026-11-28/). `tests/test_cluster.py` reads it through a
live cluster."""

from __future__ import annotations

from mlx_relay.http.loads import worker_loads
from mlx_relay.messages.admission import REJECT_REASONS, AdmissionStats


def stats(running: int, queued: int) -> AdmissionStats:
    return AdmissionStats(state="ready", detail="", running=running, queued=queued, max_num_seqs=16, max_queue=64,
                          admitted=running + queued, rejected=dict.fromkeys(REJECT_REASONS, 0))


def test_busy_slots_are_utilization_not_kv_fill() -> None:
    load = worker_loads(stats(14, 3)).loads[0]
    counts = (load.num_running_reqs, load.num_waiting_reqs, load.num_total_reqs, load.max_running_requests)
    assert counts == (14, 3, 17, 16)
    assert load.utilization == 14 / 16
    assert load.token_usage == 0.0 and load.num_used_tokens == 0 and load.max_total_num_tokens == 0


def test_utilization_is_capped_at_one() -> None:
    assert worker_loads(stats(16, 40)).loads[0].utilization == 1.0

"""Aggregates of a set of request records: pure functions, no I/O, no clock.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, "type 7").
Throughputs count successful requests only, over the time the target was driven (`elapsed_s`).
Output tokens are `usage.completion_tokens`, or the content chunk count when a server sends no
usage. Goodput is the rate of successful requests that meet every objective the user set: time
to first token, mean inter-token latency of the request, end-to-end latency.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import msgspec

from mlx_relay.bench.records import RequestRecord


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    """Latency objectives, in milliseconds; None: no objective on that measure."""

    ttft_ms: float | None = None
    itl_ms: float | None = None  # on the request's mean inter-token latency
    e2e_ms: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.itl_ms, self.e2e_ms))


class Stats(msgspec.Struct, frozen=True):
    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    requests: int  # measured (finished) requests, ok or not
    ok: int
    errors: dict[str, int]  # error kind -> requests
    violations: dict[str, int]  # violation kind -> requests
    elapsed_s: float
    req_per_s: float
    output_tok_per_s: float
    total_tok_per_s: float
    goodput_req_per_s: float | None  # None when no objective was set
    slo_met: int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty sequence, linear interpolation."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> Stats:
    if not values:
        return Stats()
    return Stats(n=len(values), mean=sum(values) / len(values), p50=percentile(values, 50),
                 p90=percentile(values, 90), p99=percentile(values, 99), max=max(values))


def output_tokens(record: RequestRecord) -> int:
    return record.completion_tokens if record.completion_tokens is not None else record.content_chunks


def mean_itl_s(record: RequestRecord) -> float | None:
    return sum(record.itl_s) / len(record.itl_s) if record.itl_s else None


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """A successful request within every objective (no ITL objective fails a one-chunk answer)."""
    if not record.ok:
        return False
    if slo.ttft_ms is not None and (record.ttft_s is None or record.ttft_s * 1e3 > slo.ttft_ms):
        return False
    itl = mean_itl_s(record)
    if slo.itl_ms is not None and itl is not None and itl * 1e3 > slo.itl_ms:
        return False
    return not (slo.e2e_ms is not None and (record.e2e_s is None or record.e2e_s * 1e3 > slo.e2e_ms))


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1e3 for v in values if v is not None]


def _rate(count: float, elapsed_s: float) -> float:
    return count / elapsed_s if elapsed_s > 0 else 0.0


def summarize(records: Sequence[RequestRecord], elapsed_s: float, slo: Slo = Slo()) -> Summary:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    completion = sum(output_tokens(r) for r in ok)
    met = sum(meets_slo(r, slo) for r in ok) if slo.active else None
    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=dict(sorted(Counter(r.error for r in records if r.error is not None).items())),
        violations=dict(sorted(Counter(v for r in records for v in r.violations).items())),
        elapsed_s=elapsed_s,
        req_per_s=_rate(len(ok), elapsed_s),
        output_tok_per_s=_rate(completion, elapsed_s),
        total_tok_per_s=_rate(prompt + completion, elapsed_s),
        goodput_req_per_s=None if met is None else _rate(met, elapsed_s),
        slo_met=met,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        ttft_ms=stats(_ms(r.ttft_s for r in ok)),
        itl_ms=stats(_ms(x for r in ok for x in r.itl_s)),
        e2e_ms=stats(_ms(r.e2e_s for r in ok)),
    )


# Metrics compared across targets: (key, label, higher is better).
COMPARED: tuple[tuple[str, str, bool], ...] = (
    ("req_per_s", "req/s", True),
    ("output_tok_per_s", "out tok/s", True),
    ("goodput_req_per_s", "goodput req/s", True),
    ("ttft_ms.p50", "TTFT p50", False),
    ("ttft_ms.p90", "TTFT p90", False),
    ("ttft_ms.p99", "TTFT p99", False),
    ("itl_ms.p50", "ITL p50", False),
    ("itl_ms.p90", "ITL p90", False),
    ("itl_ms.p99", "ITL p99", False),
    ("e2e_ms.p50", "e2e p50", False),
    ("e2e_ms.p90", "e2e p90", False),
    ("e2e_ms.p99", "e2e p99", False),
)


def metric(summary: Summary, key: str) -> float | None:
    """A metric by dotted key ("req_per_s", "ttft_ms.p99")."""
    value: object = summary
    for part in key.split("."):
        value = getattr(value, part)
    return float(value) if isinstance(value, int | float) else None


def ratios(base: Summary, other: Summary) -> dict[str, float | None]:
    """other / base for each compared metric (None where either is missing or base is 0)."""
    out: dict[str, float | None] = {}
    for key, _, _ in COMPARED:
        a, b = metric(base, key), metric(other, key)
        out[key] = b / a if a is not None and b is not None and a != 0 else None
    return out

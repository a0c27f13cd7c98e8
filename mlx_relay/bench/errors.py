"""Errors of the load-test harness: each failure the harness itself can hit is its own type.

Failures of the requests under test are *not* exceptions: they are counted in each request's
record as an `ErrorKind` (see `mlx_relay.bench.records`), because a load test must carry on.
"""

from __future__ import annotations


class BenchError(Exception):
    """Base of the harness's own failures (bad scenario, unsafe target, ...)."""


class ScenarioError(BenchError):
    """A scenario file that cannot be found, parsed or validated."""


class UnsafeTarget(BenchError):
    """A target that is not loopback and was not allowed explicitly with `--allow-host`."""


class TargetError(BenchError):
    """A target URL that is malformed or that cannot be used (bad scheme, no host)."""

"""The harness's public API in one place: `from mlx_relay.bench.api import BenchRun, ...`."""

from mlx_relay.bench.client import HttpDriver
from mlx_relay.bench.errors import BenchError, ScenarioError, TargetError, UnsafeTarget
from mlx_relay.bench.inprocess import InProcessDriver
from mlx_relay.bench.metrics import Slo, Summary, summarize
from mlx_relay.bench.records import Measurement, RequestRecord
from mlx_relay.bench.report import Report, TargetInfo, build_report, markdown, write_report
from mlx_relay.bench.runner import BenchResult, BenchRun, Level, RunConfig
from mlx_relay.bench.safety import check_target
from mlx_relay.bench.scenario import Scenario, load_scenario
from mlx_relay.bench.workload import BenchRequest, build_jobs

__all__ = [
    "BenchError",
    "BenchRequest",
    "BenchResult",
    "BenchRun",
    "HttpDriver",
    "InProcessDriver",
    "Level",
    "Measurement",
    "Report",
    "RequestRecord",
    "RunConfig",
    "Scenario",
    "ScenarioError",
    "Slo",
    "Summary",
    "TargetError",
    "TargetInfo",
    "UnsafeTarget",
    "build_jobs",
    "build_report",
    "check_target",
    "load_scenario",
    "markdown",
    "summarize",
    "write_report",
]

"""SMG, the router in front: its command line from a `RouterConfig`, and its readiness (every
worker registered and healthy, from SMG's own `GET /workers`).

SMG is run as `smg launch` with this interpreter (the `cluster` extra installs it), through
`smg_main.py`, which stops it when its stdin ends (the supervisor is gone). What it
reads from each worker is documented in docs/cluster.md: `/health` (registration and periodic
probes), `/v1/models` (the model id), `/v1/loads` (load, every `load_poll_interval_s`).
"""

from __future__ import annotations

import importlib.util
import sys

import httpx

from mlx_relay.cluster.config import RouterConfig
from mlx_relay.cluster.replicas import Child


class RouterMissing(Exception):
    """SMG is not installed in this environment."""


def router_argv(config: RouterConfig, worker_urls: tuple[str, ...]) -> list[str]:
    if importlib.util.find_spec("smg") is None:
        raise RouterMissing("SMG is not installed: pip install 'mlx-relay[cluster]' (or pip install smg)")
    argv = [sys.executable, "-m", "mlx_relay.cluster.smg_main", "launch",
            "--host", config.host, "--port", str(config.port),
            "--worker-urls", *worker_urls,
            "--policy", config.policy,
            "--cache-threshold", str(config.cache_threshold),
            "--balance-abs-threshold", str(config.balance_abs_threshold),
            "--balance-rel-threshold", str(config.balance_rel_threshold),
            "--health-check-interval-secs", str(config.health_check_interval_s),
            "--load-monitor-interval", str(config.load_poll_interval_s),
            "--shutdown-grace-period-secs", str(max(1, round(config.shutdown_grace_s))),
            "--log-level", config.log_level]
    if config.metrics_port is not None:
        argv += ["--prometheus-host", config.host, "--prometheus-port", str(config.metrics_port)]
    if config.api_key is not None:
        argv += ["--api-key", config.api_key]
    return [*argv, *config.extra_args]


class Router(Child):
    def __init__(self, config: RouterConfig, worker_urls: tuple[str, ...]) -> None:
        super().__init__("router", router_argv(config, worker_urls))
        self.config = config
        self.worker_urls = worker_urls
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        self.url = f"http://{host}:{config.port}"

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Until SMG lists every worker as ready and healthy (it registers them in the background
        after it starts listening); ProcessExited if it ends first, TimeoutError past `timeout_s`."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

        async def all_ready(client: httpx.AsyncClient) -> bool:
            return set(self.worker_urls) <= await self._ready_workers(client)

        await self.wait_until(all_ready, timeout_s, poll_s, headers)

    async def _ready_workers(self, client: httpx.AsyncClient) -> set[str]:
        r = await client.get(self.url + "/workers")
        if r.status_code != 200:
            return set()
        return {w["url"] for w in r.json().get("workers", []) if w.get("is_healthy") and w.get("status") == "ready"}

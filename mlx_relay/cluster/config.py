"""The cluster's configuration (built once by `cluster/cli.py`, passed whole to the supervisor)."""

from __future__ import annotations

from typing import Literal

import msgspec


class RouterConfig(msgspec.Struct, frozen=True):
    """SMG's knobs that matter here (`smg launch --help` has the rest: `extra_args` passes them)."""

    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"  # SMG's --policy
    # a request is pinned to the worker whose tree matches at least this share of its prefix
    cache_threshold: float = 0.3
    # the matched worker is skipped for the least-loaded one when its load exceeds the mean by
    # this many requests AND this multiple of the mean (SMG's spill gate)
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    health_check_interval_s: int = 5  # SMG probes each worker's /health this often
    load_poll_interval_s: int = 2  # SMG polls each worker's /v1/loads this often
    metrics_port: int | None = None  # SMG's own Prometheus exposition (None: no port of its own chosen)
    api_key: str | None = None  # sent to the workers (their --api-key)
    log_level: Literal["debug", "info", "warn", "error"] = "warn"
    shutdown_grace_s: float = 30.0  # in-flight requests the router waits for on SIGTERM
    extra_args: tuple[str, ...] = ()  # more `smg launch` flags, as given


class ClusterConfig(msgspec.Struct, frozen=True):
    """`mlx-relay cluster MODEL --replicas N ...`: N local replicas on ports port+1..port+N (each its
    own process and prefix cache) and any remote workers, behind one router on `router.port`."""

    model: str | None  # None: the embedded default model (as `mlx-relay serve`)
    router: RouterConfig
    replicas: int = 2
    worker_urls: tuple[str, ...] = ()  # workers started elsewhere (`mlx-relay serve --host 0.0.0.0` there)
    serve_args: tuple[str, ...] = ()  # flags every local replica's `mlx-relay serve` gets
    replica_host: str = "127.0.0.1"  # where local replicas listen (the router reaches them there)
    # replica i's GPU as CUDA_VISIBLE_DEVICES gives it (one entry per local replica; "0", "1", or a
    # UUID); empty: every replica sees the devices the cluster sees
    replica_devices: tuple[str, ...] = ()
    ready_timeout_s: float = 600.0  # a replica (or the router's registration) must be ready within this
    drain_timeout_s: float = 30.0  # the replicas' --drain-timeout; they get this plus a margin to exit

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise ValueError("ClusterConfig.replicas must not be negative")
        if self.replicas == 0 and not self.worker_urls:
            raise ValueError("a cluster needs local replicas or --worker-url workers")
        if self.replica_devices and len(self.replica_devices) != self.replicas:
            raise ValueError(f"--replica-devices names {len(self.replica_devices)} devices for "
                             f"{self.replicas} local replicas: one each")
        if any(not d or any(c.isspace() or c == "," for c in d) for d in self.replica_devices):
            raise ValueError(f"--replica-devices: not a device list: {','.join(self.replica_devices)!r}")

    def replica_env(self, index: int) -> dict[str, str]:
        """What replica `index` (from 1) gets in its environment beyond the cluster's own."""
        return {"CUDA_VISIBLE_DEVICES": self.replica_devices[index - 1]} if self.replica_devices else {}

    def replica_urls(self) -> tuple[str, ...]:
        return tuple(f"http://{self.replica_host}:{self.router.port + i}" for i in range(1, self.replicas + 1))

    def all_worker_urls(self) -> tuple[str, ...]:
        return self.replica_urls() + self.worker_urls

"""The cluster's lifetime: start the local replicas, wait until each is ready, start SMG in front and
wait until it has registered every worker; then run until SIGINT/SIGTERM or until the router exits.

Stopping is the same on every path (a signal, a replica that never got ready, a router that died):
one SIGTERM to the router (it stops taking requests and waits for its in-flight ones) and one to
every replica at the same time (each drains: its running requests finish within --drain-timeout,
the rest end with a retryable error), each killed if it has not exited by its deadline. A replica
that dies while the cluster runs is reported and left to the router, which routes around it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import anyio

from mlx_relay.cluster.config import ClusterConfig
from mlx_relay.cluster.replicas import Child, ProcessExited, Replica, serve_argv
from mlx_relay.cluster.router import Router

EXIT_MARGIN_S = 15.0  # beyond a child's own drain or grace period before it is killed


def build_replicas(config: ClusterConfig) -> list[Replica]:
    # each replica's log lines carry its name (they share the cluster's stderr), unless the serve args name it
    named = any(a == "--log-name" or a.startswith("--log-name=") for a in config.serve_args)

    def args(i: int) -> tuple[str, ...]:
        return config.serve_args if named else (*config.serve_args, "--log-name", f"replica-{i}")

    return [Replica(i, url, serve_argv(config.model, config.replica_host, config.router.port + i, args(i)),
                    config.replica_env(i))
            for i, url in enumerate(config.replica_urls(), start=1)]


async def run_cluster(config: ClusterConfig, announce: Callable[[str], None]) -> int:
    """Runs the cluster until a signal (exit status 0) or a failure (1). RouterMissing is raised
    before any process starts."""
    router = Router(config.router, config.all_worker_urls())
    replicas = build_replicas(config)
    status = 0
    try:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    async for sig in signals:
                        announce(f"{signal.Signals(sig).name}: stopping the router and draining the replicas")
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                try:
                    await _start(config, router, replicas, announce, tg.start_soon)
                    code = await router.wait()
                    raise ProcessExited(router.name, code)
                except (ProcessExited, TimeoutError) as exc:
                    announce(f"stopping: {exc or 'a replica or the router was not ready in time'}")
                    status = 1
                    tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await _stop_all(config, router, replicas)
            announce("cluster stopped")
    return status


async def _start(config: ClusterConfig, router: Router, replicas: list[Replica], announce: Callable[[str], None],
                 spawn: Callable[..., object]) -> None:
    for replica in replicas:
        await replica.start()
    for replica in replicas:  # they boot side by side; waiting for each in turn costs no extra time
        await replica.wait_ready(config.ready_timeout_s)
        device = f" on GPU {replica.env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in replica.env else ""
        announce(f"replica {replica.index} pid={replica.pid} url={replica.url} ready{device}")
        spawn(_report_exit, replica, announce)
    await router.start()
    await router.wait_ready(config.ready_timeout_s)
    announce(f"router pid={router.pid} url={router.url} policy={config.router.policy} "
             f"workers={','.join(router.worker_urls)} ready")
    announce(f"cluster ready on {router.url}")


async def _report_exit(replica: Replica, announce: Callable[[str], None]) -> None:
    code = await replica.wait()
    announce(f"replica {replica.index} (pid {replica.pid}) exited with status {code}; the router routes around it")


async def _stop_all(config: ClusterConfig, router: Router, replicas: list[Replica]) -> None:
    deadlines: list[tuple[Child, float]] = [(router, config.router.shutdown_grace_s + EXIT_MARGIN_S)]
    deadlines += [(r, config.drain_timeout_s + EXIT_MARGIN_S) for r in replicas]
    async with anyio.create_task_group() as tg:
        for child, deadline in deadlines:
            tg.start_soon(child.stop, deadline)

"""`mlx-relay cluster`: several `mlx-relay serve` replicas behind SMG (the SGLang Model Gateway) with
its cache-aware policy, or SMG alone in front of replicas on other hosts.

Nothing of the routing is ours: SMG picks the replica (prefix affinity, load balance, retries on a
dead worker). This package only starts and stops processes, in order:

    config.py      ClusterConfig / RouterConfig: what the command was asked for, typed and whole
    replicas.py    a local replica: an `mlx-relay serve` subprocess, ready when its /health says so
    router.py      SMG's command line from a RouterConfig; ready when every worker is registered
    supervisor.py  the lifetime: replicas, then the router; SIGINT/SIGTERM stops the router and
                   drains the replicas; a router that exits takes the replicas down with it
    cli.py         the `cluster` subcommand's flags (unknown flags go to `serve`, checked first)

The worker side SMG reads (`/health`, `/v1/models`, `/v1/loads`) is in `mlx_relay/http/`.
"""

"""`mlx-relay cluster`: the subcommand's flags (mlx_relay.cli calls in here).

    mlx-relay cluster MODEL --replicas 2 --port 8000 [serve flags]      # 2 local replicas + SMG
    mlx-relay cluster --port 8000 --worker-url http://gpu1:8000 --worker-url http://gpu2:8000

Flags this parser does not know are `mlx-relay serve` flags for every local replica; they are
parsed by `serve`'s own parser first, so a typo fails here and not in N children.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from mlx_relay.cluster.config import ClusterConfig, RouterConfig
from mlx_relay.cluster.router import RouterMissing
from mlx_relay.cluster.supervisor import run_cluster


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `cluster` on the subparsers of the `mlx-relay` parser."""
    p = sub.add_parser(
        "cluster", help="N replicas behind SMG's cache-aware router (or SMG in front of remote workers)",
        description="Start N local replicas of `mlx-relay serve` (ports PORT+1..PORT+N, each with its own prefix "
                    "cache) and SMG, the SGLang Model Gateway, on PORT with its cache-aware policy: the turns of "
                    "one agent session go to the replica that holds its prefix. Other flags go to every replica's "
                    "`mlx-relay serve`. Needs the `cluster` extra (pip install 'mlx-relay[cluster]').")
    p.add_argument("model", nargs="?", default=None, help="as for `mlx-relay serve` (default: the embedded model)")
    p.add_argument("--replicas", type=int, default=None,
                   help="local replicas (default 2, or 0 when --worker-url is given)")
    p.add_argument("--host", default="127.0.0.1", help="where the router listens (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the router's port; replicas take the next ones")
    p.add_argument("--worker-url", action="append", default=[], metavar="URL",
                   help="a worker already running elsewhere, e.g. http://gpu1:8000 (repeatable)")
    p.add_argument("--replica-devices", default=None, metavar="D,D,...",
                   help="one GPU per local replica, as CUDA_VISIBLE_DEVICES names it (e.g. 0,1: replica 1 on "
                        "GPU 0, replica 2 on GPU 1); default: every replica sees every GPU")
    r = p.add_argument_group("router (SMG's flags of the same names; `smg launch --help` lists the rest)")
    r.add_argument("--policy", default="cache_aware", help="SMG's routing policy (default cache_aware)")
    r.add_argument("--cache-threshold", type=float, default=0.3,
                   help="matched-prefix share that pins a request to the worker holding it (default 0.3)")
    r.add_argument("--balance-abs-threshold", type=int, default=64,
                   help="spill to the least-loaded worker past the mean load plus this many requests (default 64)")
    r.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and past this multiple of the mean load (default 1.5)")
    r.add_argument("--router-metrics-port", type=int, default=None,
                   help="SMG's own Prometheus port (default: the port after the last replica's)")
    r.add_argument("--router-log-level", choices=("debug", "info", "warn", "error"), default="warn")
    r.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more `smg launch` argument, as given (repeatable; e.g. --router-arg=--disable-retries)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds each replica, and the router's registration of the workers, may take (default 600)")
    return p


def split_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The `mlx-relay` command line as the cluster's flags and the serve flags it passes on. A serve
    flag's value before MODEL would be taken for MODEL, so that order is refused."""
    args, rest = parser.parse_known_args(argv)
    model = getattr(args, "model", None)
    if model is not None and model in argv:
        at = argv.index(model)
        if at > 0 and argv[at - 1] in rest and argv[at - 1].startswith("-"):
            parser.error(f"is {model!r} the value of {argv[at - 1]}? give MODEL first, or write "
                         f"{argv[at - 1]}={model}")
    return args, rest


def config_from_args(args: argparse.Namespace, serve_args: list[str], serve: argparse.Namespace) -> ClusterConfig:
    """`serve`: `serve_args` as serve's own parser read them (mlx_relay/cli.py owns it)."""
    for flag in ("--host", "--port"):
        if any(a == flag or a.startswith(flag + "=") for a in serve_args):
            raise SystemExit(f"mlx-relay cluster: {flag} is the cluster's own (replicas take --port+1..)")
    replicas = args.replicas if args.replicas is not None else (0 if args.worker_url else 2)
    metrics_port = args.router_metrics_port if args.router_metrics_port is not None else args.port + replicas + 1
    router = RouterConfig(host=args.host, port=args.port, policy=args.policy, cache_threshold=args.cache_threshold,
                          balance_abs_threshold=args.balance_abs_threshold,
                          balance_rel_threshold=args.balance_rel_threshold, metrics_port=metrics_port,
                          api_key=(serve.api_key or [None])[0], log_level=args.router_log_level,
                          shutdown_grace_s=serve.drain_timeout, extra_args=tuple(args.router_arg))
    return ClusterConfig(model=args.model, router=router, replicas=replicas, worker_urls=tuple(args.worker_url),
                         serve_args=tuple(serve_args), ready_timeout_s=args.ready_timeout,
                         replica_devices=tuple(args.replica_devices.split(",")) if args.replica_devices else (),
                         drain_timeout_s=serve.drain_timeout)


def run_from_args(args: argparse.Namespace, serve_args: list[str], serve: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, serve_args, serve)
    except ValueError as exc:
        print(f"mlx-relay cluster: {exc}", file=sys.stderr)
        return 2

    def announce(line: str) -> None:
        print(f"mlx-relay cluster: {line}", flush=True)

    try:
        return anyio.run(run_cluster, config, announce)
    except RouterMissing as exc:
        print(f"mlx-relay cluster: {exc}", file=sys.stderr)
        return 2

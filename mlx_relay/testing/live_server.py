"""A real server on a free loopback port, in a background thread: for tests and benchmarks.

    with LiveServer(config) as server:
        local_http.get(server.url + "/health")

The server thread runs its own event loop with the server `mlx-relay serve` runs
(`http.server.build_server`: uvicorn, the app's lifespan booting the Relay and its GPU thread,
the same timeouts and drain); `__enter__` returns once `/health` says ready. `drain()` does what
SIGTERM does to the real process. `call` runs a coroutine on the server's loop with its Relay
(what HTTP does not expose: the engine's stats, the actors themselves). `boot` serves a model pool
instead of the one model of `config` (`pool.pool.ModelPool.boot`); `served` is what it serves.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

import httpx
import msgspec

from mlx_relay.config import ServerConfig
from mlx_relay.http.lifecycle import Lifecycle
from mlx_relay.http.served import BootServed, Served, one_model
from mlx_relay.http.server import build_server
from mlx_relay.relay import Relay
from mlx_relay.testing import local_http

T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port_range(count: int, seed: int | None = None) -> int:
    """A port P with P..P+count-1 free on loopback, taken *below* the system's ephemeral range: a
    range held free for a while (a cluster binds its router's ports only after its replicas are
    up) must not be handed meanwhile to another test's `bind(0)`, which draws from that range."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(seed)
    for _ in range(200):
        base = rng.randrange(10000, max(low - count, 10001))
        try:
            for port in range(base, base + count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free ports in a row below {low}")


class LiveServer:
    def __init__(self, config: ServerConfig, *, port: int | None = None, wait_ready: bool = True,
                 timeout_s: float = 300.0, boot: BootServed | None = None) -> None:
        self.config = msgspec.structs.replace(config, host="127.0.0.1", port=port or free_port())
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.wait_ready = wait_ready
        self.timeout_s = timeout_s
        self.lifecycle = Lifecycle(on_ready=self._on_ready)
        self.served: Served | None = None  # once ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server = build_server(msgspec.structs.replace(self.config, log_level="warning"), self.lifecycle,
                                    boot=boot or one_model(Relay.start))
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve())

    def _on_ready(self, served: Served) -> None:  # on the server's loop
        self.served, self._loop = served, asyncio.get_running_loop()

    @property
    def relay(self) -> Relay | None:
        """The Relay of the one model served (a pool's default model, while loaded); None before ready."""
        return self.served.relay(None) if self.served is not None else None

    def call(self, fn: Callable[[Relay], Coroutine[Any, Any, T]], timeout_s: float = 300.0) -> T:
        """`fn(relay)` run on the server's event loop (from any other thread); its result."""
        return self.call_served(lambda served: fn(served.relay(None)), timeout_s)

    def call_served(self, fn: Callable[[Served], Coroutine[Any, Any, T]], timeout_s: float = 300.0) -> T:
        """`fn(served)` run on the server's event loop (from any other thread); its result."""
        if self.served is None or self._loop is None:
            raise RuntimeError("the server is not ready")
        return asyncio.run_coroutine_threadsafe(fn(self.served), self._loop).result(timeout_s)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during start-up")
            try:
                r = local_http.get(self.url + "/health", timeout=2.0)
                if not self.wait_ready or r.status_code == 200:
                    return self
                if r.json().get("status") == "failed":
                    raise RuntimeError(f"server failed to start: {r.json().get('error')}")
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"server not ready within {self.timeout_s}s")

    def drain(self) -> None:
        """Start the graceful drain (as the first SIGTERM does); the server stops once drained."""
        self._server.handle_exit(15, None)

    def join(self, timeout_s: float) -> bool:
        """Wait for the server to stop; True if it did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.should_exit = True
        self._thread.join(60)

"""Runs the HTTP front end: uvicorn serving the Starlette app, whose lifespan boots the Relay
core (so `/health` answers 503 loading/warming until the model is ready).

The process's lifetime, in one place (`Lifecycle`): boot progress, ready, failure (an actor that
cannot be restarted: the process exits 1 so a supervisor restarts it) and the graceful drain.
The first SIGTERM or SIGINT drains (`Relay.drain`: new requests get 503 while the running ones
finish within `--drain-timeout`, the rest end with a retryable error as their terminal event),
then the server exits 0; a second signal exits at once. uvicorn's own handling (close the
listener, wait, then cut every stream) is replaced by `RelayServer.handle_exit`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from mlx_relay.config import ServerConfig
from mlx_relay.http.app import create_app
from mlx_relay.http.guard import HeaderDeadlineProtocol
from mlx_relay.http.lifecycle import Lifecycle
from mlx_relay.http.served import BootServed

if TYPE_CHECKING:
    from mlx_relay.http.served import Served

log = logging.getLogger(__name__)


class RelayServer(uvicorn.Server):
    """uvicorn's server with the relay's signal handling (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.draining = False
        self.forced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining:  # a second signal: exit at once
            self.forced = True
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        self.lifecycle.request_drain()


def build_server(config: ServerConfig, lifecycle: Lifecycle, *, boot: BootServed) -> RelayServer:
    """The server `mlx-relay serve` runs (tests run the same one on a free port). `boot` starts
    what it serves in the app's lifespan (the composition root passes `one_model(Relay.start)`
    or a model pool's)."""
    lifecycle.on_drained = _chain(lifecycle.on_drained, lambda: setattr(server, "should_exit", True))
    app = create_app(config, lifecycle=lifecycle, boot=boot)
    server = RelayServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            http=HeaderDeadlineProtocol.with_header_timeout(config.limits.read_timeout_s),
            log_level=config.log_level,
            log_config=None,  # uvicorn's lines go to the root logger, in the process's --log-format
            access_log=config.log_level == "debug",
            lifespan="on",
            timeout_graceful_shutdown=5,  # after the drain, only idle connections are left
        ),
        lifecycle,
    )
    return server


def _chain(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        if first is not None:
            first()
        then()

    return both


def serve(config: ServerConfig, boot: BootServed, progress: Callable[[str], None] | None = None) -> int:
    """Serve until drained (exit code 0), failed (1: the model did not load, or an actor could not
    be restarted) or stopped at once by a second signal (1)."""
    failed: list[str] = []
    served: list[bool] = []

    def on_ready(what: Served) -> None:
        served.append(True)
        print(f"mlx-relay ready: {what.ready_line()} on http://{config.host}:{config.port}", flush=True)

    def on_failed(reason: str) -> None:
        failed.append(reason)
        what = "stopped serving" if served else "could not load"
        print(f"mlx-relay: {what} {config.model}: {reason}", file=sys.stderr, flush=True)
        server.should_exit = True

    lifecycle = Lifecycle(on_progress=progress, on_ready=on_ready, on_failed=on_failed)
    server = build_server(config, lifecycle, boot=boot)
    try:
        server.run()
    except KeyboardInterrupt:  # a Ctrl-C outside uvicorn's handlers (e.g. during start-up)
        return 1
    return 1 if failed or server.forced else 0

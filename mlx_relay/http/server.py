"""Runs the HTTP front end: uvicorn serving the Starlette app, whose lifespan boots the Relay
core (so `/health` answers 503 loading/warming until the model is ready)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import uvicorn

from mlx_relay.config import ServerConfig
from mlx_relay.http.app import create_app
from mlx_relay.relay import Relay


def serve(config: ServerConfig, progress: Callable[[str], None] | None = None) -> int:
    """Serve until interrupted; returns the process exit code (1 if the model failed to load)."""
    failed: list[str] = []
    holder: dict[str, uvicorn.Server] = {}

    def on_ready(relay: Relay) -> None:
        if relay.error is not None:
            failed.append(str(relay.error))
            print(f"mlx-relay: could not load {config.model}: {relay.error}", file=sys.stderr, flush=True)
            holder["server"].should_exit = True
            return
        info = relay.info
        assert info is not None
        print(
            f"mlx-relay ready: model {config.served_model_name} ({info.model_type}, {info.backend.upper()} "
            f"backend, context {info.context_length}) on http://{config.host}:{config.port}",
            flush=True,
        )

    app = create_app(config, on_progress=progress, on_ready=on_ready)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=config.log_level == "debug",
            timeout_graceful_shutdown=30,
        )
    )
    holder["server"] = server
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its orderly shutdown
        pass
    return 1 if failed else 0

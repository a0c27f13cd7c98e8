"""`mlx-relay serve` in a process of its own, for the benchmarks that measure a real server from
outside (its own cores, its own memory): started on a free loopback port, returned once it prints
its ready line, stopped with SIGTERM (the drain) and waited for."""

from __future__ import annotations

import os
import subprocess
import sys

from mlx_relay.testing.live_server import free_port


class ServeProcess:
    def __init__(self, *args: str) -> None:
        """`args`: what follows `mlx-relay serve` (a model, flags) but the port."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_relay.cli", "serve", *args, "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("mlx-relay ready"):
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {line!r}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)

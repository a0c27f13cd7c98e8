"""A local replica: one `mlx-relay serve` subprocess on its own port, with its own prefix cache.

It runs in a session of its own, so a Ctrl-C at the terminal reaches only the supervisor, which
then sends each replica exactly one SIGTERM (our serve drains on the first and exits at once on a
second). Its stdin is a pipe whose write end only the supervisor holds (and never writes to): if
the supervisor dies, even by SIGKILL, the kernel closes that end and the child reads end-of-file,
on which our serve drains and exits (`--exit-on-stdin-eof`) and SMG stops (`smg_main.py`). So no
child outlives the supervisor, on Linux and macOS alike, without polling. Ready is what its
`/health` says (200 once the model is loaded and warmed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable

import anyio
import httpx
from anyio.abc import Process


class ProcessExited(Exception):
    """A child exited while it was expected to run (its name and exit status)."""

    def __init__(self, name: str, returncode: int | None) -> None:
        super().__init__(f"{name} exited with status {returncode}")
        self.name = name
        self.returncode = returncode


def serve_argv(model: str | None, host: str, port: int, serve_args: tuple[str, ...]) -> list[str]:
    """`mlx-relay serve` as this interpreter runs it (no PATH lookup)."""
    argv = [sys.executable, "-m", "mlx_relay.cli", "serve"]
    if model is not None:
        argv.append(model)
    return [*argv, "--host", host, "--port", str(port), "--exit-on-stdin-eof", *serve_args]


class Child:
    """A subprocess the supervisor owns: started in its own session with stdin a pipe from the
    supervisor (its end is the child's lifeline), stopped with one signal and a deadline, killed
    past it."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.env = env or {}  # set in the child's environment, over the supervisor's
        self.process: Process | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        self.process = await anyio.open_process(self.argv, stdin=subprocess.PIPE, stdout=None, stderr=None,
                                                start_new_session=True,
                                                env={**os.environ, **self.env} if self.env else None)

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    async def wait_until(self, ready: Callable[[httpx.AsyncClient], Awaitable[bool]], timeout_s: float,
                         poll_s: float = 0.2, headers: dict[str, str] | None = None) -> None:
        """Until `ready(client)` says so; ProcessExited if the process ends first, TimeoutError past
        `timeout_s`. A child process's readiness can only be asked for, so this asks every `poll_s`
        (a transport error counts as not yet: the child is not listening yet)."""
        async with httpx.AsyncClient(timeout=2.0, headers=headers or {}) as client:
            with anyio.fail_after(timeout_s):
                while True:
                    if self.returncode is not None:
                        raise ProcessExited(self.name, self.returncode)
                    try:
                        if await ready(client):
                            return
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(poll_s)

    async def stop(self, deadline_s: float) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `deadline_s`; its exit status."""
        if self.process is None or self.process.returncode is not None:
            return self.returncode
        self.process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(deadline_s):
            return await self.process.wait()
        self.process.kill()
        return await self.process.wait()


class Replica(Child):
    """`mlx-relay serve` on `url`."""

    def __init__(self, index: int, url: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(f"replica {index}", argv, env)
        self.index = index
        self.url = url

    async def wait_ready(self, timeout_s: float, poll_s: float = 0.2) -> None:
        """Until `/health` answers 200 (`Child.wait_until`)."""

        async def healthy(client: httpx.AsyncClient) -> bool:
            return (await client.get(self.url + "/health")).status_code == 200

        await self.wait_until(healthy, timeout_s, poll_s)

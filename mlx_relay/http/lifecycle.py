"""The server process's lifetime as the app sees it: boot progress, ready, failure (an actor that
cannot be restarted) and the graceful drain (`Served.drain`: the relay's, or every loaded model's
in a pool), asked for from any thread or signal
handler, or by the end of stdin (`--exit-on-stdin-eof`: a supervisor that holds the pipe's other
end and never writes to it has died, even by SIGKILL, and the kernel closed its end). `http/server.py`
wires it to uvicorn and the process's exit code; the app's lifespan (`http/app.py`) runs it beside
the relay.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from mlx_relay.http.served import Served

log = logging.getLogger(__name__)


class Lifecycle:
    """What the process around the app hears from it, and how it asks the app to drain."""

    def __init__(
        self,
        *,
        on_progress: Callable[[str], None] | None = None,
        on_ready: Callable[[Served], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
        on_drained: Callable[[], None] | None = None,
    ) -> None:
        self.on_progress = on_progress
        self.on_ready = on_ready
        self.on_failed = on_failed
        self.on_drained = on_drained
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Event | None = None
        self._drain_asked = False

    def request_drain(self) -> None:
        """From any thread or a signal handler."""
        self._drain_asked = True
        if self._loop is not None and self._drain is not None:
            self._loop.call_soon_threadsafe(self._drain.set)

    async def run(self, served: Served, drain_timeout_s: float, *, drain_on_stdin_eof: bool = False) -> None:
        """In the app's lifespan, beside the relay: announce, watch for failure, drain on request
        (and, with `drain_on_stdin_eof`, when stdin ends)."""
        self._loop, self._drain = asyncio.get_running_loop(), asyncio.Event()
        if self._drain_asked:
            self._drain.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._announce, served)
            tg.start_soon(self._watch_failure, served)
            if drain_on_stdin_eof:
                tg.start_soon(self._drain_on_stdin_eof)
            await self._drain.wait()
            report = await served.drain(drain_timeout_s)
            flushed = "" if report.flushed is None else (
                f"; prefix cache flushed ({report.flushed.entries} snapshots, {report.flushed.bytes} bytes)")
            log.warning("drained in %.1fs (%d requests ended at the deadline)%s", report.seconds, report.ended,
                        flushed)
            if self.on_drained is not None:
                self.on_drained()
            tg.cancel_scope.cancel()

    async def _drain_on_stdin_eof(self) -> None:
        await stdin_closed(sys.stdin.fileno())
        log.warning("stdin closed (the process that started this server is gone): draining")
        assert self._drain is not None
        self._drain.set()

    async def _announce(self, served: Served) -> None:
        await served.ready.wait()
        if self.on_ready is not None and served.error is None:
            self.on_ready(served)

    async def _watch_failure(self, served: Served) -> None:
        await served.failed.wait()
        if self.on_failed is not None:
            self.on_failed(f"{type(served.error).__name__}: {served.error}" if served.error else "failed")


async def stdin_closed(fd: int) -> None:
    """Returns when the pipe on `fd` reaches its end (every writer closed it); what is written
    to it is read and dropped. Waits on the event loop, no thread and no polling."""
    while True:
        await anyio.wait_readable(fd)
        if not os.read(fd, 65536):
            return

"""The one thread that touches MLX.

MLX streams are thread-local and concurrent device access crashes, so model loading, prefill,
decode, vision encoding and cache slicing all run here. Other code hands it callables through
`submit` (returns a concurrent Future) and it interleaves them with the stepper's `step()`:
commands are drained between steps, and the thread sleeps on its queue only when the stepper
has no work. Nothing polls.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stepper(Protocol):
    @property
    def has_work(self) -> bool: ...

    def step(self) -> None: ...


class _StopThread:
    pass


_STOP = _StopThread()


class GPUThread:
    def __init__(self, name: str, on_fatal: Callable[[BaseException], None]) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | _StopThread] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._on_fatal = on_fatal
        self.stepper: Stepper | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((lambda: fn(*args), future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to finish its current step and exit; waits for it."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                busy = self.stepper is not None and self.stepper.has_work
                if not self._drain(block=not busy):
                    return
                if self.stepper is not None and self.stepper.has_work:
                    self.stepper.step()
        except BaseException as exc:  # the loop itself broke: the owner restarts us
            log.exception("GPU thread died")
            self._on_fatal(exc)

    def _drain(self, *, block: bool) -> bool:
        """Run queued commands; False once asked to stop."""
        try:
            item = self._queue.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(item, _StopThread):
                return False
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True

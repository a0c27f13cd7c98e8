"""The one thread that touches MLX.

MLX streams are thread-local and concurrent device access crashes, so model loading, prefill,
decode, vision encoding and cache slicing all run here. Other code hands it callables through
`submit` (returns a concurrent Future) and it interleaves them with the stepper's `step()`:
commands are drained between steps, and the thread sleeps on its queue only when the stepper
has no work. Nothing polls. Each step's result that is not empty goes to `on_output` (the
GPUExecutor posts it to the event loop in one call). If the loop itself fails, `on_fatal` is
called and every command queued then or submitted later fails with `GPUThreadDied` (nobody
waits forever on a dead thread).

A thread stuck in a call that never returns (a pipeline's collective whose peer died) can be
*abandoned* from another thread: the command it runs and every one queued or submitted later
fail with `GPUThreadDied` at once, and the loop ends if the call ever returns.

A stopped GPUThread finishes its commands, drops its stepper and then *parks* (blocks, as a
daemon) instead of exiting: MLX's CPU backend can abort the process at exit when a thread that
ran MLX work has ended before (ml-explore/mlx#3126, still seen with mlx 0.32.4 on Linux;
pinned by tests/test_shutdown.py). A parked thread holds no MLX state and costs one idle stack.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Stepper(Protocol):
    @property
    def has_work(self) -> bool: ...

    def step(self) -> Any: ...


class GPUThreadDied(RuntimeError):
    """The command was not run: the GPU thread's loop failed."""


class _StopThread:
    pass


_STOP = _StopThread()


class GPUThread:
    def __init__(self, name: str, on_fatal: Callable[[BaseException], None],
                 on_output: Callable[[Any], None] = lambda _out: None) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | _StopThread] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._on_fatal = on_fatal
        self._on_output = on_output
        self._stopped = threading.Event()
        self._park = threading.Event()  # never set: a stopped thread waits here until exit
        self._died: BaseException | None = None
        self._running: Future[Any] | None = None  # the command being run now
        self.stepper: Stepper | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((lambda: fn(*args), future))
        if self._died is not None:  # put after the thread failed its queue: fail it here
            self._fail_queued()
        return future

    def stop(self, timeout: float | None = None) -> bool:
        """Ask the thread to finish its queued commands and stop; waits until it has.
        Returns False if it did not stop within `timeout`."""
        if self._thread.is_alive() and not self._stopped.is_set():
            self._queue.put(_STOP)
        return self._stopped.wait(timeout) if self._thread.is_alive() else True

    def abandon(self, cause: BaseException) -> None:
        """From another thread, when the thread is stuck for good: its current command and every
        queued or later one fail with `GPUThreadDied` now; the loop ends if the call returns."""
        self._died = cause
        self._fail_queued()
        running = self._running
        if running is not None:
            try:
                running.set_exception(GPUThreadDied(f"the GPU thread is abandoned: {cause}"))
            except InvalidStateError:  # it has just finished
                pass

    def _run(self) -> None:
        try:
            while self._died is None:
                busy = self.stepper is not None and self.stepper.has_work
                if not self._drain(block=not busy):
                    break
                if self.stepper is not None and self.stepper.has_work:
                    output = self.stepper.step()
                    if output and self._died is None:
                        self._on_output(output)
        except BaseException as exc:  # the loop itself broke: the owner restarts us
            if self._died is None:  # (abandoned: its owner knows already)
                log.exception("GPU thread died")
                self._died = exc
                self._fail_queued()
                self._on_fatal(exc)
        self.stepper = None
        self._stopped.set()
        self._park.wait()

    def _fail_queued(self) -> None:
        """After a failure (any thread): every command still queued fails instead of waiting."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if not isinstance(item, _StopThread) and item[1].set_running_or_notify_cancel():
                item[1].set_exception(GPUThreadDied(f"the GPU thread died: {type(self._died).__name__}"))

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
                self._running = future
                try:
                    result = fn()
                except BaseException as exc:
                    _settle(future, exc=exc)
                else:
                    _settle(future, result)
                self._running = None
            if self._died is not None:  # abandoned meanwhile: what is left was failed
                return False
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """A command's outcome, unless `abandon` has already failed it."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass

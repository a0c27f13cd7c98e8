"""The engine in a process of its own: the server's side of the pipe, an `EngineHandle` (`handle.py`).

    GPUExecutor --commands (event loop)--> EngineProcess ==pipe==> process_main: LocalEngine
    GPUExecutor <--one call_soon_threadsafe per frame-- reader thread <== replies, step outputs

vLLM v1 runs its engine core this way: no Python work of the server (HTTP, SSE encoding, the
actors) shares a GIL with the thread that launches the kernels. The child is a fresh interpreter
(`python -m mlx_relay.engine.hosting.process_main`, never a fork: MLX and the event loop's threads do not
survive one) given one end of a socket pair as a `multiprocessing.connection.Connection` (length-
framed messages); every frame is a msgspec struct of `wire.py`, msgpack-encoded. Not
`multiprocessing`'s spawn context: it runs the server's main script again in the child (a script
without a `__main__` guard would start a second server there) and starts a resource tracker.

Commands are sent from the calling thread; one reader thread blocks on the pipe, decodes each
frame and resolves its future or hands it to the callbacks. The end of the pipe, unasked, is
the engine's death (the process was killed, or its GPU thread died): every pending future fails
with `EngineProcessDied` and `on_fatal` is called (the GPUExecutor crashes, its supervisor
restarts it, which spawns a fresh process). `stop` asks the child to exit (status 0), waits for
it and kills it past the timeout; the child also exits by itself when the server's end of the
pipe closes (the server's process ended, however it ended), so none outlives the server.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

import mlx_relay
from mlx_relay.engine.hosting.handle import EngineCallbacks
from mlx_relay.engine.hosting.wire import (
    Answer,
    Ask,
    CommandFailed,
    Died,
    Exit,
    LogLine,
    Progress,
    Stepped,
    Tell,
    ToEngine,
    ToServer,
    command_error,
    decode_answer,
    step_from_wire,
)
from mlx_relay.engine.protocol import Asked, R, Told

log = logging.getLogger(__name__)


class EngineProcessDied(RuntimeError):
    """The engine process is gone; the command was not answered."""


class EngineProcess:
    def __init__(self, callbacks: EngineCallbacks, *, log_level: int = logging.INFO) -> None:
        self._callbacks = callbacks
        self._log_level = log_level
        self.process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToServer)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the pending calls and `_gone`
        self._pending: dict[int, tuple[Future[Any], type[Asked[Any]]]] = {}  # by call id: (future, command)
        self._ids = itertools.count(1)
        self._gone: str | None = None  # why no command is answered any more
        self._stopping = False
        self._died: str | None = None  # the child's own word on its death (`Died`)
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        # the child imports this very package, wherever this process found it
        root = str(Path(mlx_relay.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        with theirs:  # only the child holds its end once it runs: its exit is the end of the pipe here
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "mlx_relay.engine.hosting.process_main", str(theirs.fileno()),
                     str(self._log_level)], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
            except BaseException:
                ours.close()
                raise
        self._conn = Connection(ours.detach())
        self._reader.start()

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        if self.process is None or self._conn is None:  # never started
            return
        self._send(Exit(timeout_s))
        try:
            self.process.wait(timeout_s + 5.0)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit within %.0fs; killing it", timeout_s + 5.0)
            self.process.kill()
            self.process.wait()
        self._reader.join(10.0)
        self._conn.close()

    # -- commands --------------------------------------------------------------------------------
    def tell(self, command: Told) -> None:
        self._send(Tell(command))  # type: ignore[arg-type]

    def ask(self, command: Asked[R]) -> Future[R]:
        future: Future[R] = Future()
        with self._lock:
            if self._gone is not None:
                future.set_exception(EngineProcessDied(self._gone))
                return future
            cid = next(self._ids)
            self._pending[cid] = (future, type(command))
        if not self._send(Ask(cid, command)):  # type: ignore[arg-type]
            self._fail(cid, EngineProcessDied("the engine process is gone"))
        return future

    # -- the pipe ----------------------------------------------------------------------------------
    def _send(self, frame: ToEngine) -> bool:
        assert self._conn is not None, "start the engine process first"
        with self._send_lock:
            try:
                self._conn.send_bytes(self._encoder.encode(frame))
                return True
            except OSError:  # the child is gone; the reader reports it
                return False

    def _fail(self, cid: int, exc: BaseException) -> None:
        with self._lock:
            future, _ = self._pending.pop(cid, (None, None))
        if future is not None and future.set_running_or_notify_cancel():
            future.set_exception(exc)

    def _read(self) -> None:
        """The reader thread: every frame to its future or callback, until the end of the pipe."""
        assert self._conn is not None
        while True:
            try:
                frame = self._decoder.decode(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            try:
                self._handle(frame)
            except Exception:  # a callback failed (the loop is closing): the pipe is still read
                log.exception("engine frame %s not handled", type(frame).__name__)
        self._ended()

    def _handle(self, frame: ToServer) -> None:
        if isinstance(frame, Stepped):
            self._callbacks.on_output(step_from_wire(frame.step))
        elif isinstance(frame, LogLine):
            logging.getLogger(frame.name).log(frame.level, "%s", frame.text)
        elif isinstance(frame, Progress):
            self._callbacks.on_progress(frame.text)
        elif isinstance(frame, Died):
            self._died = frame.reason
        elif isinstance(frame, CommandFailed):
            self._fail(frame.cid, command_error(frame.error))
        elif isinstance(frame, Answer):
            with self._lock:
                future, command = self._pending.pop(frame.cid, (None, None))
            if future is not None and command is not None and future.set_running_or_notify_cancel():
                try:
                    future.set_result(decode_answer(frame.result, command))
                except msgspec.ValidationError as exc:  # an answer of the wrong shape: the command fails
                    future.set_exception(exc)

    def _ended(self) -> None:
        """The child's end is closed: it exited (told to, or not)."""
        assert self.process is not None
        try:
            code: int | None = self.process.wait(5.0)
        except subprocess.TimeoutExpired:  # it closed its end and lives on: it must go
            self.process.kill()
            code = self.process.wait()
        reason = self._died or f"the engine process exited (exit code {code})"
        with self._lock:
            self._gone = reason
            pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineProcessDied(reason))
        if not self._stopping:
            log.error("%s", reason)
            self._callbacks.on_fatal(reason)

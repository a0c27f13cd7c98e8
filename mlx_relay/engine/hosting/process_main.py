"""The engine process's body: a LocalEngine (GPUThread + EngineCore) served over one pipe.

    server: GPUExecutor -> EngineProcess ==pipe (wire.py frames)== main thread -> LocalEngine
                                        <=========================== GPU / writer / reader threads

Started by `engine_process.EngineProcess` as `python -m mlx_relay.engine.hosting.process_main FD LOG_LEVEL`
(FD: its end of a socket pair). The main thread blocks on the pipe and
hands each command to the LocalEngine; replies, step outputs, the boot's progress and log records
are encoded and sent from the thread that has them (the GPU thread for steps: a send per step,
nothing between it and the pipe), one frame at a time under a lock. The process exits when told
(`Exit`: what is queued finishes, writes land, status 0), when the server goes away (end of the
pipe: the server's process died, so must this one) or when its GPU thread dies (status 1, after
telling the server). It exits through `os._exit`: the parked GPU thread (see `gpu_thread.py`)
must not meet the interpreter's shutdown. It ignores SIGINT and SIGTERM: a Ctrl-C in the
terminal or a service manager's SIGTERM reaches the whole process group, and the server, which
drains on them, still needs its engine until it says `Exit`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from mlx_relay.engine.hosting.handle import EngineCallbacks
from mlx_relay.engine.hosting.local_engine import LocalEngine
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
    encode_answer,
    error_to_wire,
    step_to_wire,
)
from mlx_relay.engine.protocol import BootEngine


class _Link:
    """The child's end of the pipe: frames out from any thread, one at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()

    def send(self, frame: ToServer) -> None:
        with self._lock:
            try:
                self.conn.send_bytes(self._encoder.encode(frame))
            except OSError:  # the server is gone: the main thread sees the end of the pipe and exits
                pass


class _PipeLogHandler(logging.Handler):
    """Log records go to the server, which logs them with its own handlers and format."""

    def __init__(self, link: _Link) -> None:
        super().__init__()
        self._link = link
        self.setFormatter(logging.Formatter("%(message)s"))  # the message and its traceback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._link.send(LogLine(record.name, record.levelno, self.format(record)))
        except Exception:
            self.handleError(record)


def main(conn: Connection, log_level: int) -> None:
    """Serve until told to exit or the server is gone; then exit the process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    link = _Link(conn)
    logging.basicConfig(level=log_level, handlers=[_PipeLogHandler(link)], force=True)
    code = _serve(link)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _died(link: _Link, reason: str) -> None:
    """On the dying GPU thread: tell the server, then go (the server spawns a fresh process)."""
    link.send(Died(reason))
    sys.stderr.flush()
    os._exit(1)


def _serve(link: _Link) -> int:
    decoder = msgspec.msgpack.Decoder(ToEngine)
    callbacks = EngineCallbacks(on_output=lambda out: link.send(Stepped(step_to_wire(out))),
                                on_fatal=lambda reason: _died(link, reason),
                                on_progress=lambda text: link.send(Progress(text)))
    engine: LocalEngine | None = None
    while True:
        try:
            frame = decoder.decode(link.conn.recv_bytes())
        except (EOFError, OSError):  # the server's end is closed: its process is gone
            return 0
        if engine is None and isinstance(frame, Ask) and isinstance(frame.command, BootEngine):
            engine = LocalEngine(callbacks)
            engine.start()
        if engine is None:
            logging.getLogger(__name__).error("%s before the engine booted; ignored", type(frame).__name__)
            continue
        match frame:
            case Exit(timeout_s=timeout_s):
                engine.stop(timeout_s)
                return 0
            case Tell(command=command):
                engine.tell(command)
            case Ask(cid=cid, command=command):
                _answer(link, cid, engine.ask(command))


def _answer(link: _Link, cid: int, future: Future[Any]) -> None:
    """When `future` is done (on the thread that finished it): its answer, or why it failed."""
    encoder = msgspec.msgpack.Encoder()

    def done(f: Future[Any]) -> None:
        try:
            frame: ToServer = Answer(cid, msgspec.Raw(encoder.encode(encode_answer(f.result()))))
        except BaseException as exc:
            frame = CommandFailed(cid, error_to_wire(exc))
        link.send(frame)

    future.add_done_callback(done)


if __name__ == "__main__":
    main(Connection(int(sys.argv[1])), int(sys.argv[2]))

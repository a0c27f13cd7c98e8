"""Live progress of a run on stderr: one updating line on a terminal, plain lines otherwise.

Updated by events (each finished request), never by a timer: on a terminal every record
redraws the line; elsewhere a line is printed at most every `every_s` seconds and at the end
of each load level, so logs stay short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from mlx_relay.bench.metrics import output_tokens
from mlx_relay.bench.records import RequestRecord


class Progress:
    def __init__(self, stream: TextIO, *, tty: bool | None = None, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.clock = clock
        self.level = ""
        self.target = ""
        self.total = 0
        self.done = 0
        self.errors = 0
        self.tokens = 0
        self.since = clock()
        self.last_print = float("-inf")

    def begin(self, level: str, total: int) -> None:
        self.level, self.total = level, total
        self.done = self.errors = self.tokens = 0
        self.since = self.clock()
        self.last_print = float("-inf")

    def on_target(self, label: str) -> None:
        self.target = label

    def skip(self, requests: int) -> None:
        """Requests that will not be sent (the rest of a session whose turn failed)."""
        self.total -= requests

    def on_record(self, record: RequestRecord) -> None:
        self.done += 1
        if record.ok:
            self.tokens += output_tokens(record)
        else:
            self.errors += 1
        now = self.clock()
        if self.tty or now - self.last_print >= self.every_s:
            self.last_print = now
            self._write(final=False)

    def end(self) -> None:
        self._write(final=True)

    def line(self) -> str:
        elapsed = max(self.clock() - self.since, 1e-9)
        width = 24
        filled = min(width, round(width * self.done / self.total)) if self.total else width
        bar = "█" * filled + "░" * (width - filled)
        target = f" {self.target}" if self.target else ""
        return (f"{self.level}{target} {bar} {self.done}/{self.total} req · {self.errors} err · "
                f"{self.done / elapsed:.2f} req/s · {self.tokens / elapsed:.1f} tok/s · {elapsed:.0f}s")

    def _write(self, *, final: bool) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\033[K" + ("\n" if final else ""))
        else:
            self.stream.write("bench: " + self.line() + "\n")
        self.stream.flush()

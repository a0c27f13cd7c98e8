"""Client-supplied chat templates, rendered where they cannot hurt the server (the Normalizer's
helper; only with `--allow-request-chat-template`).

A template is code: a loop nested a few thousand deep runs for minutes, and a string multiplied
a billion times exhausts memory. It is rendered by transformers' `render_jinja_template` (Jinja's
`ImmutableSandboxedEnvironment`, as `apply_chat_template` renders every checkpoint's own
template, with the tokenizer's special tokens as variables) in a worker *process* of its own
(`python -m mlx_relay.chat.template_sandbox`, msgpack frames over its stdin/stdout), with an
address-space limit; past the time limit the process is killed (a fresh one starts for the next
template). Requests with their own template wait for each other here, never for anything else.
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import msgspec

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")


class TemplateFailed(Exception):
    """The client's template did not render (it raised, was too slow or too large)."""


class TemplateSandbox:
    def __init__(self, variables: dict[str, Any], timeout_s: float, memory_bytes: int,
                 start_timeout_s: float = 60.0) -> None:
        self.variables = variables  # the tokenizer's special tokens (bos_token, eos_token, ...)
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def render(self, template: str, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               kwargs: dict[str, Any]) -> str:
        """The prompt text (add_generation_prompt, not tokenized). Blocking: call from a worker
        thread. Raises `TemplateFailed`."""
        with self._lock:
            proc = self._process()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _write(proc.stdin, [template, conversation, tools, {**self.variables, **kwargs}])
                reply = _read(proc.stdout, time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._kill()
                raise TemplateFailed(f"the chat template did not finish within {self.timeout_s:g}s") from None
            except (OSError, EOFError, ValueError):  # the process died (e.g. over its memory limit)
                self._kill()
                raise TemplateFailed("the chat template exhausted its sandbox") from None
        ok, value = reply
        if not ok:
            raise TemplateFailed(str(value))
        return str(value)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _process(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._kill()
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(self.memory_bytes)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        try:
            if _read(proc.stdout, time.monotonic() + self.start_timeout_s) != "ready":
                raise ValueError("unexpected greeting")
        except (TimeoutError, OSError, EOFError, ValueError):
            proc.kill()
            proc.wait()
            raise TemplateFailed("the template sandbox did not start") from None
        self._proc = proc
        return proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None


def _write(out: IO[bytes], value: Any) -> None:
    payload = msgspec.msgpack.encode(value)
    out.write(_HEADER.pack(len(payload)) + payload)
    out.flush()


def _read(src: IO[bytes], deadline: float) -> Any:
    fd = src.fileno()
    buf = b""
    need = _HEADER.size
    header_read = False
    while True:
        while len(buf) < need:
            left = None if deadline == float("inf") else deadline - time.monotonic()
            if left is not None and (left <= 0 or not select.select([fd], [], [], left)[0]):
                raise TimeoutError
            chunk = os.read(fd, need - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        if header_read:
            return msgspec.msgpack.decode(buf[_HEADER.size:])
        header_read = True
        need = _HEADER.size + _HEADER.unpack(buf[:_HEADER.size])[0]


def _serve(memory_bytes: int) -> None:
    """The sandbox process: render one template per frame on stdin until it closes."""
    import resource

    from transformers.utils.chat_template_utils import render_jinja_template

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    out, src = sys.stdout.buffer, sys.stdin.buffer
    _write(out, "ready")
    while True:
        try:
            template, conversation, tools, variables = _read(src, float("inf"))
        except (EOFError, OSError):
            return
        try:
            rendered, _ = render_jinja_template([conversation], tools=tools, chat_template=template,
                                                add_generation_prompt=True, **variables)
            _write(out, [True, rendered[0]])
        except MemoryError:
            _write(out, [False, "the chat template used more memory than its sandbox allows"])
        except Exception as exc:  # the template's own error, as its message says
            _write(out, [False, f"the chat template failed: {type(exc).__name__}: {str(exc)[:300]}"])


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

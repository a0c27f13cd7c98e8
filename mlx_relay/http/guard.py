"""Defences of the HTTP front end against oversized, slow and stalled clients (`RequestLimits`).

- `HeaderDeadlineProtocol`: uvicorn's h11 protocol, closing a connection whose next request's
  headers have not arrived within the read timeout (uvicorn bounds idle keep-alive connections
  but not a request that is sent slowly: slowloris).
- `RequestGuard` (ASGI middleware, outermost): a body larger than `max_request_bytes` is a 413
  (before it is read when Content-Length says so), a body not received within the read timeout a
  408, and a response write the client does not take within `stall_timeout_s` ends the response
  (a client that stops reading never holds its generation and slot forever). After a request
  with a large body has ended, the allocator hands the pages it freed back to the OS (glibc
  keeps them in its arenas: one 10 MB prompt, templated and tokenized, would otherwise leave
  the process a gigabyte larger for good).

Errors are answered in the route's own shape (`respond`: OpenAI's, or Anthropic's on
`/v1/messages*`); raised inside the app (while a handler reads its body) they reach the route's
error handling as typed `RelayError`s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlx_relay.config import RequestLimits
from mlx_relay.errors import PayloadTooLarge, RelayError, RequestTimeout
from mlx_relay.http.request_record import record_of
from mlx_relay.memory import release_freed_memory

log = logging.getLogger(__name__)


TRIM_AFTER_BYTES = 1 << 20  # a request body this large is worth a malloc_trim once it has ended
TRIM_DELAY_S = 0.5


class ClientStalled(Exception):
    """The client did not take a response write within the stall timeout."""


class RequestGuard:
    def __init__(self, app: ASGIApp, limits: RequestLimits, respond: Callable[[str, RelayError], Response]) -> None:
        self.app = app
        self.limits = limits
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        declared = _content_length(scope)
        if declared is not None and declared > limits.max_request_bytes:
            await self.respond(scope["path"], _too_large(limits))(scope, receive, send)
            return
        deadline = time.monotonic() + limits.read_timeout_s
        state = {"received": 0, "done": False}

        async def guarded_receive() -> Message:
            if state["done"]:
                return await receive()
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                message = await receive()
                if message["type"] == "http.request":
                    state["received"] += len(message.get("body", b""))
                    if state["received"] > limits.max_request_bytes:
                        raise _too_large(limits)
                    state["done"] = not message.get("more_body", False)
                else:
                    state["done"] = True
                return message
            raise RequestTimeout(f"the request body did not arrive within {limits.read_timeout_s:g}s")

        async def guarded_send(message: Message) -> None:
            with anyio.move_on_after(limits.stall_timeout_s):
                await send(message)
                return
            raise ClientStalled(f"the client took no data for {limits.stall_timeout_s:g}s")

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except ClientStalled as exc:  # the server closes the connection: the response is incomplete
            log.warning("%s %s: %s; closing", scope.get("method"), scope["path"], exc)
            record = record_of(scope)
            if record is not None:
                record.fail(exc, "client_stalled")
        finally:
            if state["received"] >= TRIM_AFTER_BYTES:  # once the connection's buffers are gone too
                timer = threading.Timer(TRIM_DELAY_S, release_freed_memory)
                timer.daemon = True
                timer.start()


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _too_large(limits: RequestLimits) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limits.max_request_bytes} bytes (--max-request-bytes)")


class HeaderDeadlineProtocol(H11Protocol):
    """Closes a connection whose next request's headers are not complete within `header_timeout_s`
    (from the connection's start, and from each response's end); uvicorn's keep-alive timeout
    does the rest. Build it with `with_header_timeout`."""

    header_timeout_s: float = 30.0

    @classmethod
    def with_header_timeout(cls, seconds: float) -> type[HeaderDeadlineProtocol]:
        return type(cls.__name__, (cls,), {"header_timeout_s": seconds})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._relay_header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._relay_header_timer is not None:
            self._relay_header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._relay_header_timer is not None:
            self._relay_header_timer.cancel()
        waiting_after = self.cycle  # a new request replaces it once its headers are complete
        self._relay_header_timer = asyncio.get_running_loop().call_later(
            self.header_timeout_s, self._header_deadline_passed, waiting_after)

    def _header_deadline_passed(self, waiting_after: object) -> None:
        self._relay_header_timer = None
        if self.cycle is waiting_after and not self.transport.is_closing():
            log.info("closing a connection whose request headers did not arrive within %gs", self.header_timeout_s)
            self.transport.close()

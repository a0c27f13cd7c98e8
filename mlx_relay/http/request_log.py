"""The request id and the request log: ASGI middleware, the app's outermost.

`RequestLog` gives every HTTP request an id (the client's `x-request-id` when it is 1 to 128
visible ASCII characters, else a fresh one), returns it as `x-request-id` on the response (errors
and streams included) and, once the request is over (answered, failed, streamed to its end, cut
by a client that went away or by the drain), writes exactly one line to the
`mlx_relay.requests` logger with the record the request filled in on its way
(`http/request_record.py`): request id, method, route, model, status, stream, prompt / cached /
completion tokens, time to the first token, duration, finish reason, error and its OpenAI error
type, response id; the prompt's and the reply's text only with `--log-prompts`. The line is
INFO, except for `/health` and `/metrics` (polled by probes and scrapers; the state changes
/health reports are logged where they happen): DEBUG.

An exception that reaches it before the response started is answered here, in the route's error
shape (so that answer carries the id too); a streamed response the client left is logged as
`ClientDisconnected`.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_relay.errors import ClientDisconnected, RelayError
from mlx_relay.http.errors import as_relay_error
from mlx_relay.http.request_record import STATE_KEY, RequestRecord

log = logging.getLogger("mlx_relay.requests")

HEADER = b"x-request-id"
MAX_ID_CHARS = 128
_VALID_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_ID_CHARS)
QUIET_ROUTES = ("/health", "/metrics")  # polled by probes and scrapers: logged at DEBUG


def request_id_of(scope: Scope) -> str:
    """The client's `x-request-id` if it is 1-128 visible ASCII characters, else a fresh id."""
    for name, value in scope["headers"]:
        if name == HEADER:
            if _VALID_ID.fullmatch(value.strip()):
                return value.strip().decode("ascii")
            break
    return uuid.uuid4().hex


class RequestLog:
    def __init__(self, app: ASGIApp, log_prompts: bool, respond: Callable[[str, RelayError], Response]) -> None:
        self.app = app
        self.log_prompts = log_prompts
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(request_id_of(scope), scope["method"], scope["path"], self.log_prompts)
        scope.setdefault("state", {})[STATE_KEY] = record
        header = (HEADER, record.request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # an ASGI 2.4 server's way to say the client went away mid-stream
            record.fail(ClientDisconnected("the client went away"))
        except Exception as exc:
            if record.status is not None:  # the response started: nothing more can be said to the client
                record.fail(exc)
                raise
            await self.respond(scope["path"], as_relay_error(exc))(scope, receive, send_with_id)
        finally:
            if record.stream and not record.stream_ended and record.status is not None and record.status < 400:
                record.fail(ClientDisconnected("the client went away"))
            route = scope.get("route")
            record.route = getattr(route, "path", None) or scope["path"]
            emit(record)


def emit(record: RequestRecord) -> None:
    """The request's one line."""
    level = logging.DEBUG if record.route in QUIET_ROUTES else logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "request", extra={"fields": record.fields()})

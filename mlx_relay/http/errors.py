"""Errors as HTTP responses: what any failure tells the client (`as_relay_error`), and the
default error shape, OpenAI's `{"error": {...}}`, which every route but Anthropic's answers in
(OpenAI chat and completions, Responses, the server's own routes; Anthropic's shape is
`formats/anthropic/errors.py`).

Every error answer (OpenAI's shape or Anthropic's) is an `ErrorResponse`: sent, it writes the
error into the request's record for the request log (`http/request_record.py`)."""

from __future__ import annotations

import logging
import re
import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from mlx_relay.errors import (
    InternalError,
    InvalidRequest,
    ModelNotFound,
    NotReady,
    Overloaded,
    RelayError,
    UnprocessableRequest,
)
from mlx_relay.http.request_record import record_of
from mlx_relay.runtime import ActorStopped

log = logging.getLogger(__name__)

_PATH = re.compile(r"at `\$\.?([^`]*)`")


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    """OpenAI's error shape."""

    error: ErrorDetail


def decode_error(exc: msgspec.DecodeError) -> RelayError:
    """A body that is not JSON is a 400; JSON that does not fit the schema is a 422."""
    if isinstance(exc, msgspec.ValidationError):
        match = _PATH.search(str(exc))
        return UnprocessableRequest(str(exc), param=match.group(1) if match else None)
    return InvalidRequest(f"request body is not valid JSON: {exc}")


def leaf_error(exc: BaseException) -> BaseException:
    """The error inside task-group wrappers: the first RelayError, else the first leaf."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [leaf_error(e) for e in exc.exceptions]
    return next((e for e in leaves if isinstance(e, RelayError)), leaves[0] if leaves else exc)


def as_relay_error(exc: BaseException) -> RelayError:
    """What the client is told: a RelayError as itself; anything else an `InternalError` whose
    message names an incident id logged here with the details (no internal text leaves)."""
    exc = leaf_error(exc)
    if isinstance(exc, RelayError):
        return exc
    if isinstance(exc, ActorStopped):
        return NotReady("the server is shutting down")
    incident = uuid.uuid4().hex[:12]
    log.error("incident %s: %s", incident, type(exc).__name__, exc_info=exc)
    return InternalError(f"the server failed while handling this request (incident {incident})")


def error_body(err: RelayError) -> bytes:
    return msgspec.json.encode(
        ErrorBody(ErrorDetail(message=err.message, type=err.type, param=err.param, code=err.code))
    )


class ErrorResponse(Response):
    """An error answer (JSON, Retry-After where the error says when to come back) that tells the
    request log which error it answers."""

    def __init__(self, err: RelayError, body: bytes, status: int) -> None:
        headers = {"Retry-After": str(err.retry_after_s)} if isinstance(err, Overloaded | NotReady) else {}
        super().__init__(body, status_code=status, media_type="application/json", headers=headers)
        self.error = err

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = record_of(scope)
        if record is not None:
            record.fail(self.error)
            if record.model is None and isinstance(self.error, ModelNotFound):
                record.model = self.error.model
        await super().__call__(scope, receive, send)


def error_response(exc: BaseException) -> Response:
    err = as_relay_error(exc)
    return ErrorResponse(err, error_body(err), err.status)


async def handle_exception(request: Request, exc: Exception) -> Response:
    return error_response(exc)

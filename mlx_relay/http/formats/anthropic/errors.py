"""Anthropic's error shape, `{"type": "error", "error": {"type": ..., "message": ...}}`, which
every `/v1/messages*` route answers in (the app's own 404/405 and middleware refusals too:
`is_anthropic_path`), with the error's words where clients parse them. A body that does not
fit the schema is a 400 `invalid_request_error` here (`decode`), not OpenAI's 422.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from mlx_relay.errors import (
    InvalidRequest,
    MaxTokensExceedContext,
    NotFound,
    NotReady,
    Overloaded,
    PromptTooLong,
    RelayError,
    Unauthorized,
    UnprocessableRequest,
)
from mlx_relay.http.body import decode_body
from mlx_relay.http.errors import ErrorResponse, as_relay_error

Handler = Callable[[Request], Awaitable[Response]]
B = TypeVar("B")
PATHS = ("/v1/messages", "/messages")


def is_anthropic_path(path: str) -> bool:
    """Whether `path` answers in Anthropic's error shape."""
    return path.startswith(PATHS)


ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]


class ErrorDetail(msgspec.Struct):
    type: ErrorType
    message: str


class ErrorBody(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorDetail


def _error_type(err: RelayError) -> ErrorType:
    if isinstance(err, Unauthorized):
        return "authentication_error"
    if isinstance(err, NotFound):
        return "not_found_error"
    if isinstance(err, Overloaded):
        return "rate_limit_error"
    if isinstance(err, NotReady):
        return "overloaded_error"
    if isinstance(err, InvalidRequest | UnprocessableRequest) or 400 <= err.status < 500:
        return "invalid_request_error"
    return "api_error"


def _as_error(exc: BaseException) -> RelayError:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return as_relay_error(exc)


def _message(err: RelayError) -> str:
    """The error's message in Anthropic's words where clients parse them: Claude Code reads the
    numbers of both context overflows (to lower max_tokens and retry, or to compact)."""
    if isinstance(err, MaxTokensExceedContext):
        return (f"input length and `max_tokens` exceed context limit: {err.prompt_tokens} + {err.max_tokens} > "
                f"{err.context_length}, decrease input length or `max_tokens` and try again")
    if isinstance(err, PromptTooLong):
        return f"prompt is too long: {err.prompt_tokens} tokens > {err.limit} maximum"
    return err.message


def error_body(err: RelayError) -> bytes:
    return msgspec.json.encode(ErrorBody(ErrorDetail(_error_type(err), _message(err))))


def error_response(exc: BaseException) -> Response:
    """Any failure as Anthropic's `{"type": "error", "error": {...}}`, with Retry-After where the
    error says when to come back."""
    err = _as_error(exc)
    return ErrorResponse(err, error_body(err), err.status if 400 <= err.status < 600 else 500)


def anthropic_errors(handler: Handler) -> Handler:
    """The app's global handlers answer in the OpenAI shape; these routes catch their own."""

    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as exc:
            return error_response(exc)

    return wrapped


def error_frame(exc: BaseException) -> bytes:
    return b"event: error\ndata: " + error_body(_as_error(exc)) + b"\n\n"


def decode(raw: bytes, body_type: type[B], max_depth: int) -> B:
    """A body that is not JSON or does not fit the schema is a 400 (`invalid_request_error`)."""
    try:
        return decode_body(raw, body_type, max_depth)
    except UnprocessableRequest as err:
        raise InvalidRequest(err.message, param=err.param) from None

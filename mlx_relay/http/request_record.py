"""What the request log (`http/request_log.py`) knows about one HTTP request, filled in as it goes.

The record lives in the request's ASGI scope (its `state`), put there by the `RequestLog`
middleware; whoever learns something writes it in:

- `streaming.respond` (every generation route): the model, the response id, the prompt's text
  when `--log-prompts` is on, and one `ReplyTally` per choice, which `ChatService.reply` keeps up
  to date (tokens, first token, finish reason, the reply's text when asked for);
- `streaming.sse_body`: a stream's failure, and that its terminal frames went out;
- an `errors.ErrorResponse` as it is sent: the error it answers;
- `guard.RequestGuard`: a client that stopped reading.

The middleware then writes the record out once, however the request ended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.types import Scope

from mlx_relay.errors import RelayError
from mlx_relay.service import ChatRequest, ReplyTally

STATE_KEY = "mlx_relay.request"
LOGGED_TEXT_CHARS = 32_768  # a logged prompt or reply longer than this is cut (images ride as data URLs)


@dataclass
class RequestRecord:
    request_id: str
    method: str
    path: str
    log_text: bool  # --log-prompts: the prompt's and the reply's text go into the line
    started: float = field(default_factory=time.monotonic)
    route: str | None = None  # the matched route's path template (else the path)
    model: str | None = None
    response_id: str | None = None
    stream: bool | None = None
    status: int | None = None  # the HTTP status sent
    tallies: list[ReplyTally] = field(default_factory=list)  # one per choice
    error: str | None = None  # the error's type name (e.g. ContextLengthExceeded)
    error_type: str | None = None  # its OpenAI error type (e.g. invalid_request_error)
    stream_ended: bool = False  # a stream's terminal frames went out
    prompt: str | None = None

    def begin(self, model: str, response_id: str, reqs: list[ChatRequest], stream: bool) -> list[ReplyTally]:
        """A generation route starts its replies: the tallies `ChatService.reply` keeps."""
        self.model, self.response_id, self.stream = model, response_id, stream
        self.tallies = [ReplyTally(keep_text=self.log_text) for _ in reqs]
        if self.log_text and reqs:
            self.prompt = _cut(prompt_text(reqs[0]))
        return self.tallies

    def fail(self, exc: BaseException, error_type: str | None = None) -> None:
        """The request failed (the first failure is the one logged)."""
        if self.error is not None:
            return
        self.error = type(exc).__name__
        self.error_type = error_type or (exc.type if isinstance(exc, RelayError) else "server_error")

    def fields(self) -> dict[str, Any]:
        """The log line's fields, in order (None: not known for this request)."""
        tallies = self.tallies
        first = tallies[0] if tallies else None
        ttft = None
        starts = [t.first_token_at for t in tallies if t.first_token_at is not None]
        if starts:
            ttft = round(min(starts) - self.started, 4)
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "method": self.method,
            "route": self.route or self.path,
            "model": self.model,
            "status": self.status,
            "stream": self.stream,
            "prompt_tokens": first.prompt_tokens if first else None,
            "cached_tokens": first.cached_tokens if first else None,
            "completion_tokens": sum(t.completion_tokens for t in tallies) if tallies else None,
            "ttft_s": ttft,
            "duration_s": round(time.monotonic() - self.started, 4),
            "finish_reason": _finish_reason(tallies),
            "error": self.error,
            "error_type": self.error_type,
            "response_id": self.response_id,
        }
        if self.log_text:
            out["prompt"] = self.prompt
            out["completion"] = [_cut("".join(t.pieces)) for t in tallies] if tallies else None
        return out


def record_of(scope: Scope) -> RequestRecord | None:
    """The request's record (None outside the `RequestLog` middleware, e.g. in unit tests)."""
    record = scope.get("state", {}).get(STATE_KEY)
    return record if isinstance(record, RequestRecord) else None


def prompt_text(req: ChatRequest) -> str:
    """The request's prompt as the client sent it: a raw completion prompt, or the messages as JSON."""
    if isinstance(req.prompt, str):
        return req.prompt
    if req.prompt is not None:
        return msgspec.json.encode(req.prompt).decode()
    return msgspec.json.encode(req.messages).decode()


def _finish_reason(tallies: list[ReplyTally]) -> str | None:
    """The reply's finish reason (choices that ended differently: theirs in order, `-` for one
    that did not finish); None when no reply finished."""
    reasons = [t.finish_reason for t in tallies]
    if not any(reasons):
        return None
    if len(set(reasons)) == 1:
        return reasons[0]
    return ",".join(r or "-" for r in reasons)


def _cut(text: str) -> str:
    if len(text) <= LOGGED_TEXT_CHARS:
        return text
    return f"{text[:LOGGED_TEXT_CHARS]}... ({len(text) - LOGGED_TEXT_CHARS} more characters)"

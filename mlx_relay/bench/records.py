"""What one measured request leaves behind: its timings, token counts, outcome and violations.

Drivers fill a `Measurement`; the runner stamps it with the target, load level and send time
into a `RequestRecord`. Both are plain msgspec structs, so they go to JSON as they are.
"""

from __future__ import annotations

from typing import Literal

import msgspec

# How a request failed. HTTP status classes for answers that are not 200 (the in-process driver
# maps the engine's typed errors onto the same classes through their HTTP status).
ErrorKind = Literal[
    "http_4xx",  # a 4xx other than 429 (bad request, context too long, unknown model, ...)
    "http_429",  # overloaded: the server refused the request for now
    "http_5xx",  # a server error, or 503 not ready
    "http_other",  # any other non-200 status (1xx, 3xx)
    "timeout",  # no complete answer within the request timeout
    "connection",  # could not connect, or the connection broke mid-answer
    "stream_error",  # the stream carried an error object instead of (or after) chunks
    "stream_violation",  # the answer's stream broke the protocol (a ViolationKind not in MINOR_VIOLATIONS)
    "engine_error",  # in-process only: the engine raised something that is not a typed error
]

# How a stream broke the chat.completion.chunk SSE protocol.
ViolationKind = Literal[
    "not_event_stream",  # a 200 answer whose content type is not text/event-stream
    "non_sse_line",  # a line that is not `data:`, a comment or another SSE field
    "malformed_json",  # a `data:` payload that is not JSON
    "bad_chunk_shape",  # JSON that is not a chat.completion.chunk
    "missing_object",  # a chunk of the right shape without `"object": "chat.completion.chunk"`
    "missing_finish_reason",  # a normal end with no chunk carrying a finish_reason
    "multiple_finish_reasons",  # more than one chunk carrying a finish_reason
    "content_after_finish",  # content after the chunk that carried the finish_reason
    "missing_usage",  # stream_options.include_usage asked for a usage chunk; none came
    "missing_done",  # the stream ended without `data: [DONE]`
    "data_after_done",  # anything after `data: [DONE]`
]

# Violations that leave the answer complete and measurable: counted, but the request stays ok
# (a server without usage chunks, or with a field missing, can still be compared).
MINOR_VIOLATIONS: frozenset[ViolationKind] = frozenset({"missing_object", "missing_usage"})


class Measurement(msgspec.Struct, kw_only=True):
    """One request as a driver saw it. Times are seconds since the driver sent the request."""

    ttft_s: float | None = None  # to the first chunk with content (text, reasoning or tool calls)
    itl_s: list[float] = []  # between consecutive content chunks
    e2e_s: float | None = None  # to the end of the answer
    prompt_tokens: int | None = None  # from the usage chunk
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    content_chunks: int = 0
    finish_reason: str | None = None
    error: ErrorKind | None = None
    error_detail: str = ""
    violations: list[ViolationKind] = []


class RequestRecord(Measurement, kw_only=True):
    """A `Measurement` placed in the run: which request, target and load level, when it was sent."""

    request_id: str
    scenario: str
    target: str
    level: str
    start_s: float  # send time, seconds since the run started

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def of(cls, m: Measurement, *, request_id: str, scenario: str, target: str, level: str,
           start_s: float) -> RequestRecord:
        return cls(request_id=request_id, scenario=scenario, target=target, level=level, start_s=start_s,
                   **msgspec.structs.asdict(m))


class Outcome(msgspec.Struct):
    """What a driver returns: the measurement and the text the server returned (agent sessions
    resend it as the assistant turn)."""

    measurement: Measurement
    text: str = ""


def error_kind_for_status(status: int) -> ErrorKind:
    """The error class of a non-200 HTTP status."""
    if status == 429:
        return "http_429"
    if 400 <= status < 500:
        return "http_4xx"
    if 500 <= status < 600:
        return "http_5xx"
    return "http_other"

"""Reads and checks one streamed chat completion, line by line: timings, usage and violations.

A `StreamChecker` is fed every line of an SSE body with its arrival time and never raises: each
departure from the OpenAI chat.completion.chunk protocol is recorded once as a `ViolationKind`.
The checks: every `data:` payload is JSON of the chunk shape, `"object": "chat.completion.chunk"`
included (or an `{"error": ...}` object, which is the request's error, not a violation); exactly
one chunk carries a finish_reason on a normal end; no content after it; a usage chunk when it was
asked for; `data: [DONE]` last and nothing after it. Violations outside `MINOR_VIOLATIONS` make
the request a `stream_violation` error.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from mlx_relay.bench.records import MINOR_VIOLATIONS, Measurement, ViolationKind

_SSE_FIELDS = ("event:", "id:", "retry:")


class StreamChecker:
    def __init__(self, *, expect_usage: bool = True) -> None:
        self.expect_usage = expect_usage
        self.violations: list[ViolationKind] = []
        self.content_times: list[float] = []
        self.parts: list[str] = []
        self.finish_reasons: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False

    def violate(self, kind: ViolationKind) -> None:
        if kind not in self.violations:
            self.violations.append(kind)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def feed(self, line: str, t: float) -> None:
        """One line of the body (without its line break), `t` seconds after the request was sent."""
        if not line or line.startswith(":"):  # event boundary, comment (keep-alive)
            return
        if self.done:
            self.violate("data_after_done")
            return
        if line.startswith("data:"):
            payload = line[5:]
            self._data(payload[1:] if payload.startswith(" ") else payload, t)
        elif not line.startswith(_SSE_FIELDS):
            self.violate("non_sse_line")

    def _data(self, payload: str, t: float) -> None:
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            self.violate("malformed_json")
            return
        if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
            err = obj["error"]
            self.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
            return
        if not _is_chunk(obj):
            self.violate("bad_chunk_shape")
            return
        if obj.get("object") is None:
            self.violate("missing_object")
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for choice in obj["choices"]:
            delta = choice["delta"]
            if _has_content(delta):
                if self.finish_reasons:
                    self.violate("content_after_finish")
                self.content_times.append(t)
                self.parts.append(delta.get("content") or "")
            if choice.get("finish_reason") is not None:
                self.finish_reasons.append(str(choice["finish_reason"]))
        if len(self.finish_reasons) > 1:
            self.violate("multiple_finish_reasons")

    def close(self, t: float) -> Measurement:
        """The body ended (cleanly) `t` seconds after sending: the end-of-stream checks, and the
        measurement. An error object in the stream makes the request a `stream_error`; a
        violation outside `MINOR_VIOLATIONS` (and no other error) a `stream_violation`."""
        if self.error is None:
            if not self.done:
                self.violate("missing_done")
            elif not self.finish_reasons:
                self.violate("missing_finish_reason")
            if self.done and self.expect_usage and self.usage is None:
                self.violate("missing_usage")
        return self.measurement(t)

    def measurement(self, t: float) -> Measurement:
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        times = self.content_times
        fatal = [v for v in self.violations if v not in MINOR_VIOLATIONS]
        error = "stream_error" if self.error is not None else ("stream_violation" if fatal else None)
        return Measurement(
            ttft_s=times[0] if times else None,
            itl_s=[b - a for a, b in itertools.pairwise(times)],
            e2e_s=t,
            prompt_tokens=_int(usage.get("prompt_tokens")),
            completion_tokens=_int(usage.get("completion_tokens")),
            cached_tokens=_int(details.get("cached_tokens")) if isinstance(details, dict) else None,
            content_chunks=len(times),
            finish_reason=self.finish_reasons[0] if self.finish_reasons else None,
            error=error,
            error_detail=self.error or ", ".join(self.violations),
            violations=list(self.violations),
        )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _has_content(delta: dict[str, Any]) -> bool:
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


def _is_chunk(obj: object) -> bool:
    if not isinstance(obj, dict) or obj.get("object", "chat.completion.chunk") != "chat.completion.chunk":
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("delta"), dict):
            return False
        content = choice["delta"].get("content")
        if content is not None and not isinstance(content, str):
            return False
    return True

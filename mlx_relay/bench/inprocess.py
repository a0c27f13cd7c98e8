"""The in-process driver: drives a `Relay` (the engine's actors) directly, without HTTP.

Each request becomes a `ChatRequest` for `Relay.generate` (the public in-process API), whose TokenDelta ... Finished
events are timed like stream chunks. The engine's typed errors map onto the HTTP error classes
through their status (429 -> `http_429`, 4xx, 5xx); the event stream is checked as a stream is
(one Finished, nothing after it, no end without it).
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING

import anyio
import msgspec

from mlx_relay.bench.records import ErrorKind, Measurement, Outcome, ViolationKind, error_kind_for_status
from mlx_relay.bench.workload import BenchRequest
from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.errors import RelayError
from mlx_relay.messages.gpu import Finished, TokenDelta
from mlx_relay.service import ChatRequest

if TYPE_CHECKING:
    from mlx_relay.relay import Relay


def chat_request(request: BenchRequest) -> ChatRequest:
    return ChatRequest(
        messages=msgspec.convert(request.messages, list[ChatMessage]),
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        seed=request.seed,
        tools=msgspec.convert(request.tools, list[ToolDef]) if request.tools else None,
    )


class InProcessDriver:
    def __init__(self, relay: Relay, *, label: str = "in-process", timeout_s: float = 300.0) -> None:
        self.relay = relay
        self.label = label
        self.model = relay.config.served_model_name
        self.description = f"in-process {relay.config.model}"
        self.timeout_s = timeout_s

    async def send(self, request: BenchRequest) -> Outcome:
        t0 = time.perf_counter()
        times: list[float] = []
        parts: list[str] = []
        finished: list[Finished] = []
        violations: list[ViolationKind] = []
        error: ErrorKind | None = None
        detail = ""
        with anyio.move_on_after(self.timeout_s) as scope:
            try:
                async with self.relay.generate(chat_request(request)) as events:
                    async for ev in events:
                        if isinstance(ev, TokenDelta) and ev.text:
                            if finished and "content_after_finish" not in violations:
                                violations.append("content_after_finish")
                            times.append(time.perf_counter() - t0)
                            parts.append(ev.text)
                        elif isinstance(ev, Finished):
                            finished.append(ev)
            except RelayError as exc:
                error, detail = error_kind_for_status(exc.status), f"{type(exc).__name__}: {exc}"
            except msgspec.ValidationError as exc:  # a request the API does not accept
                error, detail = "http_4xx", f"ValidationError: {exc}"
            except Exception as exc:
                error, detail = "engine_error", f"{type(exc).__name__}: {exc}"
        end = time.perf_counter() - t0
        if scope.cancelled_caught:
            error, detail = "timeout", f"no complete answer within {self.timeout_s:g}s"
        if error is None:
            if not finished:
                violations.append("missing_finish_reason")
            elif len(finished) > 1:
                violations.append("multiple_finish_reasons")
            if violations:
                error, detail = "stream_violation", ", ".join(violations)
        last = finished[0] if finished else None
        measurement = Measurement(
            ttft_s=times[0] if times else None,
            itl_s=[b - a for a, b in itertools.pairwise(times)],
            e2e_s=end,
            prompt_tokens=last.prompt_tokens if last else None,
            completion_tokens=last.completion_tokens if last else None,
            content_chunks=len(times),
            finish_reason=last.reason if last else None,
            error=error,
            error_detail=detail,
            violations=violations,
        )
        return Outcome(measurement, "".join(parts))

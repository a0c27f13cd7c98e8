"""Request-path metrics: what `ChatService` observes while a request runs, in the server's own
prometheus-client registry (vLLM's names under `mlx_relay:`, the served model as `model_name`).

    ChatService.admit    queued(waited_s)                 request_queue_time_seconds
    ChatService._start   prefix_lookup(prompt, restored)  prefix_cache_queries_total, prefix_cache_hits_total
                         loose_tools.inc(n)               tool_grammar_loose_tools_total
                         clock(arrived, prompt_tokens)    prompt_tokens_total
    RequestClock.saw     a TokenDelta                     time_to_first_token_seconds (the first),
                                                          inter_token_latency_seconds (each later token),
                                                          generation_tokens_total
                         the Finished                     e2e_request_latency_seconds, request_success_total
    RequestClock.close   no Finished came (failed, cut)   request_success_total{finished_reason="abort"}
    ReplyParser          tool_call_invalid(reason, what)  tool_calls_invalid_total{reason=...} (what the
                                                          model wrote wrong in a call, delivered as written)

A token costs one clock read and prometheus-client's own per-series locks; one reply's clock is
fed by one task only.
"""

from __future__ import annotations

import time
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram

from mlx_relay.chat.output import INVALID_REASONS
from mlx_relay.messages.gpu import Finished, FinishReason, TokenDelta

PREFIX = "mlx_relay:"

# vLLM's buckets; inter-token latency also gets 1-5 ms (a small model on a GPU decodes that fast)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, *LATENCY_BUCKETS)  # most requests never wait

Outcome = FinishReason | Literal["abort"]
OUTCOMES: tuple[str, ...] = (*get_args(FinishReason), "abort")


class RequestMetrics:
    """One server's request-path series (registered in `registry`, bound to `model_name`)."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        label = ("model_name",)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, label, registry=registry, buckets=buckets).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, label, registry=registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds",
                              "From the request's arrival to its first generated token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Between generated tokens (tokens that arrive together share the gap)", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "From the request's arrival to its last token", LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Waiting for an admission slot (the queue behind --max-num-seqs)", QUEUE_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the generations started (cached included)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens restored from the prefix cache")
        self.loose_tools = counter("tool_grammar_loose_tools",
                                   "Declared tools (tool_choice auto) whose calls the grammar held only to being "
                                   "well-formed: a schema it cannot enforce exactly")
        success = Counter(PREFIX + "request_success", "Generations ended, by finish reason (abort: failed or cut)",
                          ("model_name", "finished_reason"), registry=registry)
        self.finished = {reason: success.labels(model_name, reason) for reason in OUTCOMES}
        invalid = Counter(PREFIX + "tool_calls_invalid",
                          "Tool calls the model wrote wrong, delivered as written (undeclared tool, arguments off "
                          "the schema) or as text (unreadable); stray call markup dropped from the text",
                          ("model_name", "reason"), registry=registry)
        self.invalid_calls = {reason: invalid.labels(model_name, reason) for reason in INVALID_REASONS}

    def queued(self, waited_s: float) -> None:
        self.queue_time.observe(waited_s)

    def prefix_lookup(self, prompt_tokens: int, restored_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(restored_tokens)

    def tool_call_invalid(self, reason: str, what: str) -> None:
        """`ReplyParser`'s `on_invalid`: one thing the model wrote wrong in a tool call."""
        self.invalid_calls[reason].inc()

    def clock(self, arrived: float, prompt_tokens: int) -> RequestClock:
        """A generation starts (`arrived`: `time.perf_counter()` when its request came in)."""
        self.prompt_tokens.inc(prompt_tokens)
        return RequestClock(self, arrived)


class RequestClock:
    """One generation's timings, fed the engine's events as they pass."""

    __slots__ = ("_arrived", "_done", "_last", "_m")

    def __init__(self, metrics: RequestMetrics, arrived: float) -> None:
        self._m = metrics
        self._arrived = arrived
        self._last: float | None = None
        self._done = False

    def saw(self, event: object) -> None:
        m = self._m
        if isinstance(event, TokenDelta):
            n = len(event.token_ids)
            if not n:
                return
            now = time.perf_counter()
            m.generation_tokens.inc(n)
            if self._last is None:
                m.ttft.observe(now - self._arrived)
            else:  # an MTP round's tokens arrive together: each is one share of the gap
                gap = (now - self._last) / n
                for _ in range(n):
                    m.itl.observe(gap)
            self._last = now
        elif isinstance(event, Finished) and not self._done:
            self._done = True
            m.e2e.observe(time.perf_counter() - self._arrived)
            m.finished[event.reason].inc()

    def close(self) -> None:
        """The generation is over; without a Finished it was aborted (failed, cancelled, drained)."""
        if not self._done:
            self._done = True
            self._m.finished["abort"].inc()

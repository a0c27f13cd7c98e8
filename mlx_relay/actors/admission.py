"""Admission: decides, before any response starts, whether a request runs, waits or is refused.

A request asks for a slot with an `Acquire` *stream*: the reply `Granted` arrives when one of
`max_num_seqs` slots is free; while all are taken it waits in a queue of at most `max_queue`;
past that it is refused with `Overloaded` (HTTP 429 + Retry-After). The slot is the lifetime of
the stream: when the requester leaves its `async with` (done, failed or disconnected) the
runtime's cancellation frees the slot and the next queued request is granted. Before the model
is ready every request gets `NotReady` (HTTP 503 + Retry-After); so does every new and every
queued request once the server drains (SIGTERM), while the running ones finish. `WhenIdle`
answers when no slot is held (the drain waits on it; nothing polls).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

from mlx_relay.config import AdmissionConfig
from mlx_relay.errors import InvalidRequest, NotReady, Overloaded
from mlx_relay.messages.admission import (
    REJECT_REASONS,
    Acquire,
    AdmissionStats,
    GetStats,
    Granted,
    Idle,
    RejectReason,
    SetState,
    State,
    WhenIdle,
)
from mlx_relay.runtime import Actor, ReplyStream


class Admission(Actor):
    accepts = (Acquire, SetState, GetStats, WhenIdle)
    mailbox_capacity = 4096

    def __init__(self, config: AdmissionConfig, max_num_seqs: int) -> None:
        self.config = config
        self.max_num_seqs = max_num_seqs  # the engine's (`EngineConfig.max_num_seqs`): one slot a sequence
        self.state: State = "loading"
        self.detail = ""
        self.running: dict[int, tuple[float, int]] = {}  # stream id -> (granted at, slots)
        self.queue: OrderedDict[int, tuple[ReplyStream, float, int]] = OrderedDict()
        self.mean_hold_s = 2.0
        self.admitted = 0
        self.rejected: dict[RejectReason, int] = dict.fromkeys(REJECT_REASONS, 0)
        self.idle_waiters: list[ReplyStream] = []

    async def receive(self, msg: Acquire | SetState | GetStats | WhenIdle, stream: ReplyStream | None) -> object:
        match msg:
            case Acquire(slots=slots):
                assert stream is not None
                self._acquire(stream, slots)
            case SetState(state=state, detail=detail):
                self.state, self.detail = state, detail
                if state != "ready":  # nothing queued will be granted: refuse it now (503)
                    self._refuse_queued()
            case WhenIdle():
                assert stream is not None
                self.idle_waiters.append(stream)
                self._notify_idle()
            case GetStats():
                return AdmissionStats(
                    state=self.state,
                    detail=self.detail,
                    running=self._used(),
                    queued=len(self.queue),
                    max_num_seqs=self.max_num_seqs,
                    max_queue=self.config.max_queue,
                    admitted=self.admitted,
                    rejected=dict(self.rejected),
                )
        return None

    def _used(self) -> int:
        return sum(slots for _, slots in self.running.values())

    def _not_ready_reason(self) -> RejectReason:
        return "draining" if self.state == "draining" else "not_ready"

    def _refuse_queued(self) -> None:
        for waiting, _, _ in self.queue.values():
            self.rejected[self._not_ready_reason()] += 1
            waiting.fail(NotReady(f"the server is {self.state}"))
        self.queue.clear()

    def _notify_idle(self) -> None:
        if self.running:
            return
        for waiter in self.idle_waiters:
            waiter.send(Idle())
            waiter.close()
        self.idle_waiters.clear()

    def _acquire(self, stream: ReplyStream, slots: int) -> None:
        if self.state != "ready":
            self.rejected[self._not_ready_reason()] += 1
            raise NotReady(f"the server is {self.state}" + (f": {self.detail}" if self.detail else ""))
        if not 1 <= slots <= self.max_num_seqs:
            self.rejected["too_many_sequences"] += 1
            raise InvalidRequest(f"this server decodes at most {self.max_num_seqs} sequences at once; "
                                 f"{slots} were asked for", param="n")
        if self._used() + slots <= self.max_num_seqs and not self.queue:
            self._grant(stream, time.monotonic(), slots)
        elif len(self.queue) < self.config.max_queue:
            self.queue[stream.id] = (stream, time.monotonic(), slots)
        else:
            self.rejected["overloaded"] += 1
            waves = (len(self.queue) + 1) / self.max_num_seqs
            retry = max(1, math.ceil(self.mean_hold_s * waves))
            raise Overloaded(
                f"server overloaded: {len(self.running)} running, {len(self.queue)} queued",
                retry_after_s=retry,
            )

    def _grant(self, stream: ReplyStream, since: float, slots: int) -> None:
        now = time.monotonic()
        self.running[stream.id] = (now, slots)
        self.admitted += 1
        stream.send(Granted(waited_s=now - since))

    def on_cancel(self, stream: ReplyStream) -> None:
        if stream in self.idle_waiters:
            self.idle_waiters.remove(stream)
            return
        granted = self.running.pop(stream.id, None)
        if granted is not None:
            self.mean_hold_s = 0.9 * self.mean_hold_s + 0.1 * (time.monotonic() - granted[0])
        else:
            self.queue.pop(stream.id, None)
        # first come, first served: the head waits until its slots are free (no overtaking)
        while self.queue:
            head_id, (waiting, since, slots) = next(iter(self.queue.items()))
            if not waiting.open:
                del self.queue[head_id]
                continue
            if self._used() + slots > self.max_num_seqs:
                break
            del self.queue[head_id]
            self._grant(waiting, since, slots)
        self._notify_idle()

"""Messages of the Admission actor (`actors/admission.py`): slot leases, server state, the drain's wait."""

from __future__ import annotations

from typing import Literal

import msgspec

State = Literal["loading", "warming", "ready", "failed", "draining"]
# why Admission refused a request: the queue was full (429), the server was not ready (loading,
# warming, failed: 503) or draining (503), or it asked for more sequences than the server decodes
# at once (400)
RejectReason = Literal["overloaded", "not_ready", "draining", "too_many_sequences"]
REJECT_REASONS: tuple[RejectReason, ...] = ("overloaded", "not_ready", "draining", "too_many_sequences")


class Acquire(msgspec.Struct, frozen=True):
    """Stream request: one `Granted` when `slots` slots are free; the slots are held until the
    requester leaves the stream."""

    request_id: str
    slots: int = 1  # a request with n choices holds n slots, granted together (no partial holds)


class Granted(msgspec.Struct, frozen=True):
    waited_s: float


class SetState(msgspec.Struct, frozen=True):
    state: State
    detail: str = ""


class GetStats(msgspec.Struct, frozen=True):
    """Ask. Reply: AdmissionStats."""


class WhenIdle(msgspec.Struct, frozen=True):
    """Stream request: one `Idle` as soon as no slot is held (at once if none is)."""


class Idle(msgspec.Struct, frozen=True):
    pass


class AdmissionStats(msgspec.Struct, frozen=True):
    state: State
    detail: str
    running: int
    queued: int
    max_num_seqs: int
    max_queue: int
    admitted: int
    rejected: dict[RejectReason, int]  # requests refused since start, by reason (every reason present)

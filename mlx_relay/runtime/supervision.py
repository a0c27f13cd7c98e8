"""Supervision policy of the actor runtime: which exceptions are failures, and how a crashed
actor is brought back.

Native libraries raise exceptions that are not `Exception`s: pyo3's `PanicException` (a Rust
panic in llguidance or tokenizers) derives from `BaseException`. Everything except the signals
that steer control flow (cancellation, interpreter exit, Ctrl-C, generator close) is a failure
to be handled where it happens: `is_failure` says which.

`RestartPolicy` is one-for-one restart with exponential backoff and no give-up for crashes
while handling messages (a crash-looping input slows its own actor down, it never switches the
actor off); only an actor that cannot *start* again `max_start_failures` times in a row is
declared failed, which the system escalates (the server reports it and exits non-zero, so a
process supervisor restarts it).
"""

from __future__ import annotations

from asyncio import CancelledError

import msgspec

# control flow, never a failure to handle (anyio on asyncio cancels with CancelledError)
_CONTROL = (KeyboardInterrupt, SystemExit, GeneratorExit, CancelledError)


def is_failure(exc: BaseException) -> bool:
    """An error to handle (any exception, native panics included), not a control-flow signal.
    Usable on any thread (the GPU thread has no event loop)."""
    return not isinstance(exc, _CONTROL)


class RestartPolicy(msgspec.Struct, frozen=True):
    backoff_initial_s: float = 0.05  # the delay before the first restart after a quiet period
    backoff_max_s: float = 5.0  # the delay doubles per consecutive crash up to this
    quiet_after_s: float = 30.0  # a crash this long after the previous one starts the backoff anew
    max_start_failures: int = 5  # consecutive failed starts before the actor is declared failed

    def delay(self, consecutive: int) -> float:
        """Seconds to wait before restart number `consecutive` (1-based) of a crash series."""
        return min(self.backoff_max_s, self.backoff_initial_s * 2 ** max(0, consecutive - 1))

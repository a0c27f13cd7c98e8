"""Error types of the actor runtime.

`Rejection` is the base of every *expected* failure: a handler that raises one answers the
asker with it and carries on. Any other exception is a crash: the supervisor restarts the actor
and every request it held gets `ActorCrashed`.
"""

from __future__ import annotations


class Rejection(Exception):
    """An expected failure that is a reply to the asker, not a crash of the actor."""


class RuntimeFault(Exception):
    """Base of the failures the runtime itself reports."""


class ActorCrashed(RuntimeFault):
    """The actor holding this request raised and was restarted; the request is lost."""

    def __init__(self, actor: str, cause: BaseException | None = None) -> None:
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"actor {actor} crashed{detail}")
        self.actor = actor
        self.cause = cause


class ActorStopped(RuntimeFault):
    """The actor is stopped (shut down, or gave up after too many restarts)."""

    def __init__(self, actor: str) -> None:
        super().__init__(f"actor {actor} is stopped")
        self.actor = actor


class AskTimeout(RuntimeFault, TimeoutError):
    """An ask got no reply within its timeout."""

    def __init__(self, actor: str, timeout: float) -> None:
        super().__init__(f"actor {actor} did not answer within {timeout:g}s")
        self.actor = actor
        self.timeout = timeout

"""The frames between the GPUExecutor and its engine process (`engine_process.py` in the server,
`process_main.py` in the child): msgspec structs, msgpack-encoded, one frame per
`multiprocessing.Connection` message.

    GPUExecutor -> EngineProcess --ToEngine--> process_main -> LocalEngine (GPUThread + EngineCore)
    GPUExecutor <- EngineProcess <--ToServer-- process_main <- LocalEngine

A command of the protocol (`protocol.py`) travels as it is, in a `Tell` or, when it is asked, an
`Ask` with a call id (`cid`), answered by the one `Answer` with that id (the answer's bytes, read
with the command's answer type) or `CommandFailed`: nothing here knows one command from another.
Each step's `StepOutput` travels as `Stepped`: its events
in order, each error as a `WireError` (the class's name in `mlx_relay.errors` and the fields
those classes carry) that is rebuilt as the same class on the server's side: no pickle, and no
message text is ever parsed. Snapshot bytes never travel: the engine process writes and reads
the prefix cache's files itself, and only paths and results cross.
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from mlx_relay import errors
from mlx_relay.engine.protocol import Asked, Command, Event, StepOutput, answer_type
from mlx_relay.errors import GenerationFailed, RelayError
from mlx_relay.messages.gpu import EmbeddedVectors, Finished, TokenDelta
from mlx_relay.messages.prefix_cache import SnapshotTaken
from mlx_relay.messages.specprefill import ScoringOutcome
from mlx_relay.messages.text_mtp import MTPOutcome
from mlx_relay.messages.vision import FeaturesEncoded

# The error classes a WireError may name: every exception class of `mlx_relay.errors`.
ERROR_TYPES: tuple[type[Exception], ...] = tuple(
    v for v in vars(errors).values()
    if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == errors.__name__)
_FIELDS = ("param", "code", "retry_after_s", "model")  # what those classes carry beyond the message


class EngineFailure(RuntimeError):
    """A command failed in the engine process with an error of no class in `mlx_relay.errors`
    (`kind`: its class name there)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class WireError(msgspec.Struct, frozen=True, omit_defaults=True):
    kind: str  # the exception's class name
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None
    model: str | None = None


def error_to_wire(exc: BaseException) -> WireError:
    fields = {name: getattr(exc, name) for name in _FIELDS if getattr(exc, name, None) is not None}
    message = exc.message if isinstance(exc, RelayError) else str(exc)
    return WireError(type(exc).__name__, message, **fields)


def _known_error(err: WireError) -> Exception | None:
    """The same class with the same fields, if `mlx_relay.errors` has it."""
    cls = next((c for c in ERROR_TYPES if c.__name__ == err.kind), None)
    if cls is None:
        return None
    if not issubclass(cls, RelayError):  # a plain exception (ModelLoadError): its message only
        return cls(err.message)
    params = inspect.signature(cls).parameters
    kwargs = {name: getattr(err, name) for name in _FIELDS if name in params and getattr(err, name) is not None}
    return cls(err.message, **kwargs)


def event_error(err: WireError) -> Exception:
    """A stream's error, as raised in the engine; of a class `mlx_relay.errors` lacks: GenerationFailed."""
    return _known_error(err) or GenerationFailed(err.message)


def command_error(err: WireError) -> Exception:
    """A command's error, as raised in the engine; of a class `mlx_relay.errors` lacks: EngineFailure."""
    return _known_error(err) or EngineFailure(err.kind, err.message)


# -- a step's output ------------------------------------------------------------------------------
class Delta(msgspec.Struct, frozen=True, tag=True, array_like=True):
    sid: int
    event: TokenDelta


class Done(msgspec.Struct, frozen=True, tag=True, array_like=True):
    sid: int
    event: Finished


class Embedded(msgspec.Struct, frozen=True, tag=True, array_like=True):
    sid: int
    event: EmbeddedVectors


class Failure(msgspec.Struct, frozen=True, tag=True, array_like=True):
    sid: int
    error: WireError


class WireStep(msgspec.Struct, frozen=True, omit_defaults=True):
    """`StepOutput` on the wire: the events in their order, the side results as they are."""

    events: list[Delta | Done | Embedded | Failure] = []
    snapshots: list[SnapshotTaken] = []
    scored: list[ScoringOutcome] = []
    features: list[FeaturesEncoded] = []
    mtp: list[MTPOutcome] = []


def step_to_wire(out: StepOutput) -> WireStep:
    events: list[Delta | Done | Embedded | Failure] = []
    for sid, event in out.events:
        if isinstance(event, TokenDelta):
            events.append(Delta(sid, event))
        elif isinstance(event, Finished):
            events.append(Done(sid, event))
        elif isinstance(event, EmbeddedVectors):
            events.append(Embedded(sid, event))
        else:
            events.append(Failure(sid, error_to_wire(event)))
    return WireStep(events, out.snapshots, out.scored, out.features, out.mtp)


def step_from_wire(step: WireStep) -> StepOutput:
    events: list[tuple[int, Event]] = []
    for ev in step.events:
        if isinstance(ev, Failure):
            events.append((ev.sid, event_error(ev.error)))
        else:
            events.append((ev.sid, ev.event))
    return StepOutput(events, list(step.snapshots), list(step.scored), list(step.features), list(step.mtp))


# -- answers ----------------------------------------------------------------------------------------
def encode_answer(value: Any) -> Any:
    """An answer as msgspec encodes it (a step's output as `WireStep`)."""
    return step_to_wire(value) if isinstance(value, StepOutput) else value


def decode_answer(raw: bytes | msgspec.Raw, command: type[Asked[Any]]) -> Any:
    """The answer to a `command`, of its answer type."""
    kind = answer_type(command)
    if kind is StepOutput:
        return step_from_wire(msgspec.msgpack.decode(raw, type=WireStep))
    return msgspec.msgpack.decode(raw, type=kind)


# -- server -> engine process -------------------------------------------------------------------
class Tell(msgspec.Struct, frozen=True, tag=True):
    command: Command


class Ask(msgspec.Struct, frozen=True, tag=True):
    """Answered by `Answer` (or `CommandFailed`) with the same call id."""

    cid: int
    command: Command


class Exit(msgspec.Struct, frozen=True, tag=True):
    """Finish what is queued (writes included) and exit with status 0."""

    timeout_s: float = 30.0


ToEngine = Tell | Ask | Exit


# -- engine process -> server -------------------------------------------------------------------
class Answer(msgspec.Struct, frozen=True, tag=True):
    """The answer to `Ask(cid, command)`: encoded by `encode_answer`, read by `decode_answer`
    with the command's type, which the asker keeps."""

    cid: int
    result: msgspec.Raw


class CommandFailed(msgspec.Struct, frozen=True, tag=True):
    cid: int
    error: WireError


class Stepped(msgspec.Struct, frozen=True, tag=True):
    """One step's output (not empty)."""

    step: WireStep


class Progress(msgspec.Struct, frozen=True, tag=True):
    """A boot phase, for the operator ("loading ...")."""

    text: str


class LogLine(msgspec.Struct, frozen=True, tag=True):
    """A log record of the engine process, formatted there, logged again by the server."""

    name: str
    level: int
    text: str


class Died(msgspec.Struct, frozen=True, tag=True):
    """The engine's GPU thread failed; the process exits next."""

    reason: str


ToServer = Answer | CommandFailed | Stepped | Progress | LogLine | Died

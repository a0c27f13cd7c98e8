"""Actor base, actor references and the per-actor supervisor loop (the "cell").

An actor owns its state and sees one message at a time. Others reach it only through its
`ActorRef`: `tell` (fire and forget), `ask` (one reply, optional timeout) or `stream` (many
replies, consumed in `async with`). The cell runs the actor's loop; when a handler raises
something that is not a `Rejection`, the cell fails every request the actor held with
`ActorCrashed`, builds a fresh actor from its factory and carries on with the mailbox
(one-for-one restart, bounded by an intensity limit).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Generic, TypeVar

import anyio
import msgspec
from anyio.abc import TaskStatus

from mlx_relay.runtime.errors import ActorCrashed, ActorStopped, AskTimeout, Rejection
from mlx_relay.runtime.mailbox import Envelope, Mailbox
from mlx_relay.runtime.replies import ReplyFuture, ReplyStream

log = logging.getLogger(__name__)


class StreamCancelled(msgspec.Struct, frozen=True):
    """Control message: the consumer of stream `stream_id` left before it ended."""

    stream_id: int


class Crash(msgspec.Struct, frozen=True):
    """Control message: something the actor owns (a thread, a task) failed; restart it."""

    reason: str


class Stop(msgspec.Struct, frozen=True):
    """Control message: finish what is queued, then stop."""


class Actor:
    """Base class. Subclasses declare `accepts` and implement `receive`."""

    accepts: ClassVar[tuple[type[msgspec.Struct], ...]] = ()
    mailbox_capacity: ClassVar[int] = 256

    # Set by the cell before on_start.
    cell: ActorCell

    async def on_start(self) -> None:
        """Acquire resources. Runs before the first message (and again after a restart)."""

    async def on_stop(self) -> None:
        """Release resources. Runs at shutdown and before a restart (best effort)."""

    async def receive(self, msg: Any, stream: ReplyStream | None) -> Any:
        """Handle one message. For `ask` the return value is the reply. For `stream` the
        handler sends on `stream`; it may keep the stream open past its return (the cell holds
        it and fails it if the actor crashes)."""
        raise NotImplementedError

    def on_cancel(self, stream: ReplyStream) -> None:
        """The consumer of `stream` left early: stop the work behind it and free its slot."""

    @property
    def ref(self) -> ActorRef:
        return self.cell.ref


A = TypeVar("A", bound=Actor)


class ActorRef(Generic[A]):
    """The handle others use to reach an actor."""

    def __init__(self, cell: ActorCell) -> None:
        self._cell = cell

    @property
    def name(self) -> str:
        return self._cell.name

    async def tell(self, msg: msgspec.Struct) -> None:
        await self._cell.mailbox.put(Envelope(msg))

    def tell_nowait(self, msg: msgspec.Struct) -> bool:
        """Fire and forget without waiting (from synchronous code on the event loop): False, and
        nothing sent, when the mailbox is full or closed."""
        return self._cell.mailbox.try_put(Envelope(msg))

    async def ask(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        self._cell.mailbox.check(msg)
        future = ReplyFuture()
        try:
            with anyio.fail_after(timeout):
                await self._cell.mailbox.put(Envelope(msg, future))
                return await future.wait()
        except TimeoutError as exc:
            if isinstance(exc, AskTimeout):
                raise
            raise AskTimeout(self.name, timeout or 0.0) from None

    @asynccontextmanager
    async def stream(self, msg: msgspec.Struct) -> AsyncIterator[ReplyStream]:
        self._cell.mailbox.check(msg)
        stream = ReplyStream(next(self._cell.stream_ids), self._cell.stream_cancelled)
        await self._cell.mailbox.put(Envelope(msg, stream))
        try:
            yield stream
        finally:
            stream.cancel()

    def crash(self, reason: str) -> None:
        """Report, from the event loop, that something the actor owns failed."""
        self._cell.mailbox.put_control(Envelope(Crash(reason)))


class ActorCell:
    """Runs one actor: its loop, its held streams, its restarts."""

    def __init__(
        self,
        factory: Callable[[], Actor],
        name: str,
        accepts: tuple[type[msgspec.Struct], ...],
        capacity: int,
        max_restarts: int = 5,
        restart_window_s: float = 60.0,
    ) -> None:
        self.factory = factory
        self.name = name
        self.mailbox = Mailbox(name, (*accepts, StreamCancelled, Crash, Stop), capacity)
        self.ref: ActorRef = ActorRef(self)
        self.stream_ids = itertools.count(1)
        self.held: dict[int, ReplyStream] = {}
        self.restarts = 0
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self._recent_crashes: list[float] = []
        self.actor: Actor | None = None
        self.stopped = anyio.Event()

    def stream_cancelled(self, stream: ReplyStream) -> None:
        self.mailbox.put_control(Envelope(StreamCancelled(stream.id)))

    async def _start_actor(self) -> None:
        actor = self.factory()
        actor.cell = self
        self.actor = actor
        await actor.on_start()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._start_actor()
        except BaseException:
            self.mailbox.close()
            self.stopped.set()
            raise
        task_status.started()
        try:
            await self._loop()
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()

    async def _loop(self) -> None:
        while True:
            env = await self.mailbox.get()
            msg = env.msg
            if isinstance(msg, Stop):
                return
            if isinstance(msg, StreamCancelled):
                stream = self.held.pop(msg.stream_id, None)
                if stream is not None and self.actor is not None:
                    await self._guard(lambda a=self.actor, s=stream: _sync(a.on_cancel, s), None)
                continue
            if isinstance(msg, Crash):
                if not await self._restart(RuntimeError(msg.reason)):
                    return
                continue
            if isinstance(env.reply, ReplyStream) and env.reply.open:
                self.held[env.reply.id] = env.reply
            ok = await self._guard(lambda m=msg, r=env.reply: self._dispatch(m, r), env.reply)
            if not ok:
                return
            self._prune()

    async def _dispatch(self, msg: msgspec.Struct, reply: ReplyFuture | ReplyStream | None) -> None:
        assert self.actor is not None
        stream = reply if isinstance(reply, ReplyStream) else None
        result = await self.actor.receive(msg, stream)
        if isinstance(reply, ReplyFuture):
            reply.set(result)

    async def _guard(self, call: Callable[[], Any], reply: ReplyFuture | ReplyStream | None) -> bool:
        """Run a handler; answer rejections, restart on crashes. False: the actor gave up."""
        try:
            await call()
        except Rejection as exc:
            if reply is not None:
                reply.fail(exc)
                if isinstance(reply, ReplyStream):
                    self.held.pop(reply.id, None)
        except Exception as exc:
            log.exception("actor %s crashed", self.name)
            if reply is not None:
                reply.fail(ActorCrashed(self.name, exc))
            return await self._restart(exc)
        return True

    async def _restart(self, cause: BaseException) -> bool:
        for stream in self.held.values():
            stream.fail(ActorCrashed(self.name, cause))
        self.held.clear()
        if self.actor is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self.actor.on_stop()
                except Exception:
                    log.exception("actor %s failed in on_stop during restart", self.name)
            self.actor = None
        now = time.monotonic()
        self._recent_crashes = [t for t in self._recent_crashes if now - t < self.restart_window_s]
        self._recent_crashes.append(now)
        if len(self._recent_crashes) > self.max_restarts:
            log.error("actor %s crashed %d times in %.0fs; stopping it",
                      self.name, len(self._recent_crashes), self.restart_window_s)
            return False
        while True:
            self.restarts += 1
            try:
                await self._start_actor()
                log.warning("actor %s restarted (%d restarts)", self.name, self.restarts)
                return True
            except Exception:
                log.exception("actor %s failed to restart", self.name)
                self._recent_crashes.append(time.monotonic())
                if len(self._recent_crashes) > self.max_restarts:
                    return False

    def _prune(self) -> None:
        if self.held:
            # Only streams the actor finished: a cancelled one stays until its StreamCancelled
            # control message reaches the actor's on_cancel.
            closed = [k for k, s in self.held.items() if s.finished]
            for k in closed:
                del self.held[k]

    async def _finish(self) -> None:
        for env in self.mailbox.close():
            if env.reply is not None:
                env.reply.fail(ActorStopped(self.name))
        for stream in self.held.values():
            stream.fail(ActorStopped(self.name))
        self.held.clear()
        if self.actor is not None:
            try:
                await self.actor.on_stop()
            except Exception:
                log.exception("actor %s failed in on_stop", self.name)
            self.actor = None
        self.stopped.set()

    def request_stop(self) -> None:
        self.mailbox.put_control(Envelope(Stop()))


async def _sync(fn: Callable[[ReplyStream], None], stream: ReplyStream) -> None:
    fn(stream)

"""Actor base, actor references and the per-actor supervisor loop (the "cell").

An actor owns its state and sees one message at a time. Others reach it only through its
`ActorRef`: `tell` (fire and forget), `ask` (one reply, optional timeout) or `stream` (many
replies, consumed in `async with`). The cell runs the actor's loop; when a handler raises
anything that is not a `Rejection` (native panics included: `supervision.is_failure`), the cell
fails every request the actor held with `ActorCrashed`, builds a fresh actor from its factory
after a backoff and carries on with the mailbox (one-for-one restart, `RestartPolicy`). Only an
actor that cannot start again is declared failed; the cell then reports it to its system.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ClassVar, Generic, Literal, TypeVar

import anyio
import msgspec
from anyio.abc import TaskGroup, TaskStatus

from mlx_relay.runtime.errors import ActorCrashed, ActorStopped, AskTimeout, Rejection
from mlx_relay.runtime.mailbox import Envelope, Mailbox
from mlx_relay.runtime.replies import ReplyFuture, ReplyStream
from mlx_relay.runtime.supervision import RestartPolicy, is_failure

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

    def start_job(self, stream: ReplyStream, job: Callable[[], Awaitable[msgspec.Struct]]) -> None:
        """Answer `stream` later, off the mailbox: `job` runs as a task of the cell beside the
        actor's loop (so the next messages are handled meanwhile); its result is the stream's
        one item, a `Rejection` it raises is the reply, any other failure fails this request
        only (`ActorCrashed`). The consumer leaving cancels the job."""
        self.cell.start_job(stream, job)

    def start_task(self, task: Callable[[], Awaitable[None]]) -> None:
        """Run `task` as a task of the cell beside the actor's loop, answering nobody: background
        work the actor owns (a file write, a load whose result the actor tells itself or another
        actor). It is cancelled when the actor stops or restarts; a failure crashes the actor."""
        self.cell.start_task(task)

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

    @property
    def cell(self) -> ActorCell:
        """The cell behind this reference (the actor system starts and supervises it)."""
        return self._cell

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

    async def request(self, msg: msgspec.Struct) -> Any:
        """A stream request answered by one item (e.g. a job's result): that item. Cancelling the
        caller cancels the work (unlike `ask`, whose work runs on when its asker is gone)."""
        async with self.stream(msg) as replies:
            async for item in replies:
                return item
        raise ActorStopped(self.name)

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


CellState = Literal["starting", "running", "restarting", "failed", "stopped"]


class ActorCell:
    """Runs one actor: its loop, its held streams, its restarts."""

    def __init__(
        self,
        actor_class: type[Actor],
        name: str,
        policy: RestartPolicy = RestartPolicy(),
        on_failed: Callable[[ActorCell], None] | None = None,
    ) -> None:
        if not actor_class.accepts:
            raise ValueError(f"actor {name}: {actor_class.__name__} declares no message types it accepts")
        self.actor_class = actor_class
        self.factory: Callable[[], Actor] | None = None  # set when the actor is started (its arguments)
        self.name = name
        self.mailbox = Mailbox(name, (*actor_class.accepts, StreamCancelled, Crash, Stop),
                               actor_class.mailbox_capacity)
        self.ref: ActorRef = ActorRef(self)
        self.stream_ids = itertools.count(1)
        self.held: dict[int, ReplyStream] = {}
        self.restarts = 0
        self.policy = policy
        self.state: CellState = "starting"
        self.failure: str | None = None  # why the actor was declared failed
        self._on_failed = on_failed
        self._consecutive = 0  # crashes in the current series (backoff exponent)
        self._last_crash = -float("inf")
        self.actor: Actor | None = None
        self.stopped = anyio.Event()
        self._jobs: TaskGroup | None = None
        self._job_scopes: dict[int, anyio.CancelScope] = {}
        self._task_scopes: set[anyio.CancelScope] = set()

    def start_task(self, task: Callable[[], Awaitable[None]]) -> None:
        assert self._jobs is not None, "tasks run while the cell runs"
        scope = anyio.CancelScope()
        self._task_scopes.add(scope)
        self._jobs.start_soon(self._run_task, task, scope)

    async def _run_task(self, task: Callable[[], Awaitable[None]], scope: anyio.CancelScope) -> None:
        try:
            with scope:
                try:
                    await task()
                except BaseException as exc:
                    if not is_failure(exc):
                        raise
                    log.error("actor %s: a background task failed", self.name, exc_info=exc)
                    self.mailbox.put_control(Envelope(Crash(f"a background task failed: {type(exc).__name__}: {exc}")))
        finally:
            self._task_scopes.discard(scope)

    def start_job(self, stream: ReplyStream, job: Callable[[], Awaitable[msgspec.Struct]]) -> None:
        assert self._jobs is not None, "jobs run while the cell runs"
        scope = anyio.CancelScope()
        self._job_scopes[stream.id] = scope
        self._jobs.start_soon(self._run_job, stream, job, scope)

    async def _run_job(self, stream: ReplyStream, job: Callable[[], Awaitable[msgspec.Struct]],
                       scope: anyio.CancelScope) -> None:
        try:
            with scope:
                try:
                    result = await job()
                except Rejection as exc:
                    stream.fail(exc)
                except BaseException as exc:
                    if not is_failure(exc):
                        raise
                    log.error("actor %s: a job failed", self.name, exc_info=exc)
                    stream.fail(ActorCrashed(self.name, exc))
                else:
                    stream.send(result)
                    stream.close()
        finally:
            self._job_scopes.pop(stream.id, None)
            if stream.finished:
                self.held.pop(stream.id, None)

    def _cancel_jobs(self) -> None:
        for scope in (*self._job_scopes.values(), *self._task_scopes):
            scope.cancel()

    def stream_cancelled(self, stream: ReplyStream) -> None:
        self.mailbox.put_control(Envelope(StreamCancelled(stream.id)))

    async def _start_actor(self) -> None:
        assert self.factory is not None, "start the cell through ActorSystem.start"
        actor = self.factory()
        actor.cell = self
        self.actor = actor
        await actor.on_start()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._start_actor()
        except BaseException:
            self.mailbox.close()
            self.state = "stopped"
            self.stopped.set()
            raise
        self.state = "running"
        task_status.started()
        try:
            async with anyio.create_task_group() as self._jobs:
                await self._loop()
                self._cancel_jobs()
        finally:
            self._jobs = None
            with anyio.CancelScope(shield=True):
                await self._finish()

    async def _loop(self) -> None:
        while True:
            env = await self.mailbox.get()
            msg = env.msg
            if isinstance(msg, Stop):
                return
            if isinstance(msg, StreamCancelled):
                if (job := self._job_scopes.get(msg.stream_id)) is not None:
                    job.cancel()
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
        except BaseException as exc:
            if not is_failure(exc):
                raise
            log.error("actor %s crashed", self.name, exc_info=exc)
            if reply is not None:
                reply.fail(ActorCrashed(self.name, exc))
            return await self._restart(exc)
        return True

    async def _restart(self, cause: BaseException) -> bool:
        """Fail what the crashed actor held, then start a fresh one after the backoff; False if
        it cannot be started again (the actor is then failed and its system told)."""
        self.state = "restarting"
        self._cancel_jobs()
        for stream in self.held.values():
            stream.fail(ActorCrashed(self.name, cause))
        self.held.clear()
        if self.actor is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self.actor.on_stop()
                except BaseException as exc:
                    if not is_failure(exc):
                        raise
                    log.error("actor %s failed in on_stop during restart", self.name, exc_info=exc)
            self.actor = None
        now = time.monotonic()
        quiet = now - self._last_crash > self.policy.quiet_after_s
        self._consecutive = 1 if quiet else self._consecutive + 1
        self._last_crash = now
        delay = self.policy.delay(self._consecutive)
        for attempt in range(1, self.policy.max_start_failures + 1):
            await anyio.sleep(delay)
            self.restarts += 1
            try:
                await self._start_actor()
            except BaseException as exc:
                if not is_failure(exc):
                    raise
                log.error("actor %s failed to restart (attempt %d)", self.name, attempt, exc_info=exc)
                self.actor = None
                delay = self.policy.delay(self._consecutive + attempt)
                continue
            log.warning("actor %s restarted (%d restarts) after %s", self.name, self.restarts,
                        type(cause).__name__)
            self.state = "running"
            return True
        self.state = "failed"
        self.failure = f"could not be restarted after {type(cause).__name__}"
        log.critical("actor %s %s; giving up", self.name, self.failure)
        if self._on_failed is not None:
            self._on_failed(self)
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
            except BaseException as exc:
                if not is_failure(exc):
                    raise
                log.error("actor %s failed in on_stop", self.name, exc_info=exc)
            self.actor = None
        if self.state != "failed":
            self.state = "stopped"
        self.stopped.set()

    def request_stop(self) -> None:
        self.mailbox.put_control(Envelope(Stop()))


async def _sync(fn: Callable[[ReplyStream], None], stream: ReplyStream) -> None:
    fn(stream)

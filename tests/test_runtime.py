"""The actor runtime on its own, without models."""

from __future__ import annotations

import anyio
import msgspec
import pytest

from mlx_relay.runtime import (
    Actor,
    ActorCrashed,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    Rejection,
    ReplyStream,
)
from mlx_relay.runtime.supervision import RestartPolicy

FAST = RestartPolicy(backoff_initial_s=0.001, backoff_max_s=0.01, max_start_failures=3)


class Add(msgspec.Struct):
    n: int


class Get(msgspec.Struct):
    pass


class Boom(msgspec.Struct):
    pass


class Panic(msgspec.Struct):
    """Raise what a Rust panic arrives as through pyo3: a BaseException, not an Exception."""


class FakePanicException(BaseException):  # pyo3_runtime.PanicException's shape
    pass


class Refuse(msgspec.Struct):
    pass


class Sleep(msgspec.Struct):
    seconds: float


class Count(msgspec.Struct):
    upto: int
    hold: bool = False  # keep the stream open after sending


class Item(msgspec.Struct):
    i: int


class NotAccepted(msgspec.Struct):
    pass


class Nope(Rejection):
    pass


class Counter(Actor):
    accepts = (Add, Get, Boom, Panic, Refuse, Sleep, Count)
    mailbox_capacity = 16

    def __init__(self, log: list[str]) -> None:
        self.total = 0
        self.log = log
        self.open: dict[int, ReplyStream] = {}

    async def on_start(self) -> None:
        self.log.append("start")

    async def on_stop(self) -> None:
        self.log.append("stop")

    async def receive(self, msg, stream):
        match msg:
            case Add(n=n):
                self.total += n
                return self.total
            case Get():
                return self.total
            case Boom():
                raise RuntimeError("boom")
            case Panic():
                raise FakePanicException("end byte index 100 is not a char boundary")
            case Refuse():
                raise Nope("refused")
            case Sleep(seconds=s):
                await anyio.sleep(s)
                return s
            case Count(upto=upto, hold=hold):
                assert stream is not None
                for i in range(upto):
                    stream.send(Item(i))
                if hold:
                    self.open[stream.id] = stream
                else:
                    stream.close()

    def on_cancel(self, stream: ReplyStream) -> None:
        self.log.append(f"cancel:{stream.id}")
        self.open.pop(stream.id, None)


class SmallCounter(Counter):
    mailbox_capacity = 2


async def test_spawning_reads_the_mailbox_capacity_from_the_actor_class() -> None:
    async with ActorSystem() as system:
        small = await system.spawn(SmallCounter, [], name="small")
        default = await system.spawn(Counter, [], name="default")
        assert small.cell.mailbox.capacity == 2 and default.cell.mailbox.capacity == 16


async def test_a_reserved_reference_takes_messages_before_its_actor_starts() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = system.reserve(Counter, name="later")
        await ref.tell(Add(4))  # queued: nothing runs it yet
        assert log == []
        await system.start(ref, log)
        assert await ref.ask(Get()) == 4 and log == ["start"]
        with pytest.raises(RuntimeError):
            await system.start(ref, log)


async def test_tell_ask_and_typed_mailbox() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, log, name="counter")
        await ref.tell(Add(2))
        assert await ref.ask(Add(3)) == 5
        with pytest.raises(TypeError):
            await ref.tell(NotAccepted())
        with pytest.raises(TypeError):
            await ref.ask(NotAccepted())
    assert log == ["start", "stop"]


async def test_full_mailbox_applies_back_pressure_and_drops_nothing() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(SmallCounter, log, name="c")
        await ref.tell(Sleep(0.2))  # the actor is busy for a while
        await ref.tell(Add(1))
        await ref.tell(Add(1))  # the mailbox now holds 2 messages: full
        with anyio.move_on_after(0.05) as scope:
            await ref.tell(Add(1))
        assert scope.cancelled_caught, "a full mailbox must make the sender wait"
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(ref.tell, Add(1))
        assert await ref.ask(Get()) == 22


async def test_ask_timeout() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, [], name="c")
        with pytest.raises(AskTimeout):
            await ref.ask(Sleep(1.0), timeout=0.05)
        assert await ref.ask(Get(), timeout=5) == 0


async def test_rejection_is_a_reply_not_a_crash() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, log, name="c")
        await ref.ask(Add(7))
        with pytest.raises(Nope):
            await ref.ask(Refuse())
        assert await ref.ask(Get()) == 7
        assert system.cell("c").restarts == 0


async def test_crash_restarts_and_fails_only_held_requests() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, log, name="c")
        await ref.ask(Add(5))
        async with ref.stream(Count(upto=2, hold=True)) as held:
            assert [(await held.__anext__()).i for _ in range(2)] == [0, 1]
            with pytest.raises(ActorCrashed):
                await ref.ask(Boom())
            with pytest.raises(ActorCrashed):  # the held stream gets the error too
                await held.__anext__()
        # a fresh actor carries on with the mailbox; its state starts anew
        assert await ref.ask(Get()) == 0
        assert system.cell("c").restarts == 1
    assert log == ["start", "stop", "start", "stop"]


async def test_crash_loops_back_off_but_never_stop_the_actor() -> None:
    async with ActorSystem(policy=FAST) as system:
        ref = await system.spawn(Counter, [], name="c")
        for _ in range(12):  # far past any intensity limit
            with pytest.raises(ActorCrashed):
                await ref.ask(Boom())
        assert await ref.ask(Add(2)) == 2
        assert system.cell("c").state == "running" and system.cell("c").restarts == 12
        assert not system.failed.is_set() and system.down() == {}


async def test_a_native_panic_is_a_crash_of_one_actor_not_of_the_system() -> None:
    """A BaseException from a native library (pyo3's PanicException) fails the request that
    raised it and restarts the actor; the system and its other actors carry on."""
    log: list[str] = []
    async with ActorSystem(policy=FAST) as system:
        ref = await system.spawn(Counter, log, name="c")
        other = await system.spawn(Counter, [], name="other")
        await ref.ask(Add(3))
        with pytest.raises(ActorCrashed) as info:
            await ref.ask(Panic())
        assert isinstance(info.value.cause, FakePanicException)
        assert await ref.ask(Add(1)) == 1  # a fresh actor
        assert await other.ask(Add(5)) == 5
        assert not system.failed.is_set()
    assert log == ["start", "stop", "start", "stop"]


class StartsOnce(Counter):
    """Starts the first time only: a restart after a crash cannot bring it back."""

    def __init__(self, starts: list[int]) -> None:
        super().__init__([])
        self.starts = starts

    async def on_start(self) -> None:
        self.starts.append(1)
        if len(self.starts) > 1:
            raise OSError("the model file is gone")


async def test_an_actor_that_cannot_restart_fails_and_the_system_says_so() -> None:
    starts: list[int] = []
    async with ActorSystem(policy=FAST) as system:
        ref = await system.spawn(StartsOnce, starts, name="gpu")
        with pytest.raises(ActorCrashed):
            await ref.ask(Boom())
        with anyio.fail_after(30):  # a hang guard (the restarts take well under a second)
            await system.failed.wait()
        assert len(starts) == 1 + FAST.max_start_failures
        assert system.down() == {"gpu": "failed"} and "gpu" in (system.failure or "")
        with pytest.raises(ActorStopped):
            await ref.ask(Get())


async def test_a_restarting_actor_is_reported_down() -> None:
    slow = RestartPolicy(backoff_initial_s=0.3, backoff_max_s=0.3)
    async with ActorSystem(policy=slow) as system:
        ref = await system.spawn(Counter, [], name="c")
        with pytest.raises(ActorCrashed):
            await ref.ask(Boom())
        assert system.down() == {"c": "restarting"}
        assert await ref.ask(Get()) == 0  # queued meanwhile, answered by the fresh actor
        assert system.down() == {}


async def test_stream_and_early_exit_cancels() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, log, name="c")
        async with ref.stream(Count(upto=3)) as s:
            assert [item.i async for item in s] == [0, 1, 2]
        async with ref.stream(Count(upto=3, hold=True)) as s:
            first = await s.__anext__()
            assert first.i == 0
            sid = s.id
        await ref.ask(Get())  # the cancel has been handled by now (FIFO)
        assert f"cancel:{sid}" in log
        # a stream the actor finished is not reported as cancelled
        assert log.count(f"cancel:{sid}") == 1
        assert not any(x == "cancel:1" for x in log)


async def test_cancelling_the_consumer_task_cancels_the_work() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, log, name="c")

        async def consume() -> None:
            async with ref.stream(Count(upto=1, hold=True)) as s:
                async for _ in s:
                    pass

        with anyio.move_on_after(0.1):
            await consume()
        await ref.ask(Get())
        assert any(x.startswith("cancel:") for x in log)
        actor = system.cell("c").actor
        assert isinstance(actor, Counter) and actor.open == {}


async def test_orderly_shutdown() -> None:
    log: list[str] = []
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, log, name="c")
        async with ref.stream(Count(upto=0, hold=True)) as held:
            await ref.tell(Add(1))
            await system.stop()
            with pytest.raises(ActorStopped):
                await held.__anext__()
        with pytest.raises(ActorStopped):
            await ref.tell(Add(1))
    assert log == ["start", "stop"]


class SlowJob(msgspec.Struct):
    seconds: float
    fail: bool = False


class Worker(Actor):
    """Answers SlowJob off its mailbox (`start_job`), Get at once."""

    accepts = (SlowJob, Get)

    def __init__(self) -> None:
        self.cancelled = 0

    async def receive(self, msg, stream):
        match msg:
            case SlowJob(seconds=s, fail=fail):
                assert stream is not None

                async def job() -> Item:
                    try:
                        await anyio.sleep(s)
                    except anyio.get_cancelled_exc_class():
                        self.cancelled += 1
                        raise
                    if fail:
                        raise FakePanicException("a native panic inside a job")
                    return Item(int(s * 1000))

                self.start_job(stream, job)
            case Get():
                return self.cancelled


async def test_jobs_run_beside_the_mailbox_and_fail_alone() -> None:
    async with ActorSystem(policy=FAST) as system:
        ref = await system.spawn(Worker, name="w")
        results: list[int] = []

        async def one(s: float) -> None:
            results.append((await ref.request(SlowJob(s))).i)

        with anyio.fail_after(20):  # a hang guard; that the jobs run together is the ordering below
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one, 0.3)
                await anyio.sleep(0.05)
                assert await ref.ask(Get()) == 0  # answered while the jobs run
        assert results == [300, 300, 300]
        with pytest.raises(ActorCrashed):  # a failing job fails its own request ...
            await ref.request(SlowJob(0.0, fail=True))
        assert system.cell("w").restarts == 0  # ... and nothing else
        with anyio.move_on_after(0.05):  # the caller leaves: the job is cancelled
            await ref.request(SlowJob(5.0))
        with anyio.fail_after(10):  # a hang guard
            while await ref.ask(Get()) != 1:
                await anyio.sleep(0.01)


class Background(msgspec.Struct):
    seconds: float
    fail: bool = False


class Tasker(Actor):
    """Runs Background as a task of its own (`start_task`): nobody waits for it; it tells itself
    the result (Add) through its mailbox."""

    accepts = (Background, Add, Get)

    def __init__(self, log: list[str]) -> None:
        self.total = 0
        self.log = log

    async def receive(self, msg, stream):
        match msg:
            case Background(seconds=s, fail=fail):
                async def task() -> None:
                    try:
                        await anyio.sleep(s)
                    except anyio.get_cancelled_exc_class():
                        self.log.append("cancelled")
                        raise
                    if fail:
                        raise RuntimeError("a background write failed")
                    await self.ref.tell(Add(1))

                self.start_task(task)
            case Add(n=n):
                self.total += n
            case Get():
                return self.total


async def test_background_tasks_run_beside_the_mailbox_crash_the_actor_and_end_with_it() -> None:
    log: list[str] = []
    async with ActorSystem(policy=FAST) as system:
        ref = await system.spawn(Tasker, log, name="t")
        with anyio.fail_after(20):  # a hang guard
            for _ in range(3):
                await ref.tell(Background(0.2))
            assert await ref.ask(Get()) == 0  # answered while the tasks run
            while await ref.ask(Get()) != 3:
                await anyio.sleep(0.01)
            await ref.tell(Background(0.0, fail=True))  # a failing task crashes its actor ...
            while system.cell("t").restarts != 1:
                await anyio.sleep(0.01)
            assert await ref.ask(Get()) == 0  # ... which restarts fresh
        await ref.tell(Background(5.0))
        await anyio.sleep(0.05)
    assert log == ["cancelled"]  # the actor's stop ends its tasks

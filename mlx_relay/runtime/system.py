"""The actor system: spawns actors under one task group, stops them in reverse order.

`async with ActorSystem() as system:` then `ref = await system.spawn(Factory, name=...)`.
Spawning waits for the actor's `on_start`, so actors come up in dependency order; leaving the
block asks each actor to stop (queued messages are still handled first) in reverse order.

Crashed actors restart on their own (`RestartPolicy`); one that cannot be started again is
*failed*: the system records it in `failure` and sets `failed`, which its owner watches (the
server then reports not-ready and exits non-zero). `down()` names the actors not running now.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio
from anyio.abc import TaskGroup

from mlx_relay.runtime.actor import Actor, ActorCell, ActorRef
from mlx_relay.runtime.supervision import RestartPolicy


class ActorSystem:
    def __init__(self, *, stop_timeout_s: float = 30.0, policy: RestartPolicy = RestartPolicy()) -> None:
        self._cells: list[ActorCell] = []
        self._tg: TaskGroup | None = None
        self.stop_timeout_s = stop_timeout_s
        self.policy = policy
        self.failed = anyio.Event()  # set when an actor cannot be restarted
        self.failure: str | None = None

    async def __aenter__(self) -> ActorSystem:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        with anyio.CancelScope(shield=True):
            await self.stop()
        return await self._tg.__aexit__(exc_type, exc, tb)

    async def spawn(
        self,
        factory: Callable[[], Actor],
        *,
        name: str,
        accepts: tuple[type, ...] | None = None,
        capacity: int | None = None,
        policy: RestartPolicy | None = None,
    ) -> ActorRef:
        assert self._tg is not None, "use `async with ActorSystem()`"
        cls = factory if isinstance(factory, type) else None
        accepts = accepts if accepts is not None else (cls.accepts if cls else ())
        if not accepts:
            raise ValueError(f"actor {name}: declare the message types it accepts")
        cap = capacity if capacity is not None else (cls.mailbox_capacity if cls else 256)
        cell = ActorCell(factory, name, accepts, cap, policy or self.policy, on_failed=self._actor_failed)
        await self._tg.start(cell.run)
        self._cells.append(cell)
        return cell.ref

    def cell(self, name: str) -> ActorCell:
        for c in self._cells:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def cells(self) -> list[ActorCell]:
        return list(self._cells)

    def down(self) -> dict[str, str]:
        """The actors that are not running now (restarting after a crash, or failed): name -> state."""
        return {c.name: c.state for c in self._cells if c.state != "running"}

    def _actor_failed(self, cell: ActorCell) -> None:
        if self.failure is None:
            self.failure = f"actor {cell.name} {cell.failure}"
        self.failed.set()

    async def stop(self) -> None:
        """Stop every actor, last spawned first, each after its queued messages."""
        for cell in reversed(self._cells):
            cell.request_stop()
            with anyio.move_on_after(self.stop_timeout_s) as scope:
                await cell.stopped.wait()
            if scope.cancelled_caught and self._tg is not None:
                self._tg.cancel_scope.cancel()
        self._cells.clear()

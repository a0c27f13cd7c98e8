"""The actor system: spawns actors under one task group, stops them in reverse order.

`async with ActorSystem() as system:` then `ref = await system.spawn(ActorClass, *args, name=...)`
(Pykka's shape: the class carries its settings, `accepts` and `mailbox_capacity`; the arguments
are its constructor's, kept for restarts). Spawning waits for the actor's `on_start`, so actors
come up in dependency order; leaving the block asks each actor to stop (queued messages are
still handled first) in reverse order.

Actors that must reach each other both ways (the GPU executor reports snapshots to the prefix
cache, which tells it what to free) get their references at construction: `reserve` makes an
actor's reference (its mailbox takes messages at once, handled once it runs) and `start` starts
the actor behind it later, so no actor learns another through a message.

Crashed actors restart on their own (`RestartPolicy`); one that cannot be started again is
*failed*: the system records it in `failure` and sets `failed`, which its owner watches (the
server then reports not-ready and exits non-zero). `down()` names the actors not running now.
"""

from __future__ import annotations

from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from mlx_relay.runtime.actor import Actor, ActorCell, ActorRef
from mlx_relay.runtime.supervision import RestartPolicy

A = TypeVar("A", bound=Actor)


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

    def reserve(self, actor_class: type[A], *, name: str, policy: RestartPolicy | None = None) -> ActorRef[A]:
        """A reference to an actor not started yet (`start` starts it); messages sent meanwhile
        wait in its mailbox."""
        return ActorCell(actor_class, name, policy or self.policy, on_failed=self._actor_failed).ref

    async def start(self, ref: ActorRef[A], *args: Any, **kwargs: Any) -> ActorRef[A]:
        """Start the reserved actor behind `ref` with its constructor's arguments; waits for its
        `on_start`."""
        assert self._tg is not None, "use `async with ActorSystem()`"
        cell = ref.cell
        if cell.factory is not None:
            raise RuntimeError(f"actor {cell.name} is already started")
        cell.factory = partial(cell.actor_class, *args, **kwargs)
        await self._tg.start(cell.run)
        self._cells.append(cell)
        return ref

    async def spawn(self, actor_class: type[A], *args: Any, name: str, policy: RestartPolicy | None = None,
                    **kwargs: Any) -> ActorRef[A]:
        """Reserve and start in one: `actor_class(*args, **kwargs)` (again after each restart)."""
        return await self.start(self.reserve(actor_class, name=name, policy=policy), *args, **kwargs)

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

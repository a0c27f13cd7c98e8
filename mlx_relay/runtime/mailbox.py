"""Bounded, typed mailbox: the only way into an actor.

Messages are `msgspec.Struct` instances of the types the actor declares. A full mailbox makes
`put` wait (back-pressure); nothing is ever dropped. Control envelopes (cancellation, stop) go
through the same FIFO but never wait for room, so a cancel can always be delivered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import msgspec

from mlx_relay.runtime.errors import ActorStopped

if TYPE_CHECKING:
    from mlx_relay.runtime.replies import ReplyFuture, ReplyStream


@dataclass(slots=True)
class Envelope:
    """A message in flight with the channel its reply goes to (none for a tell)."""

    msg: msgspec.Struct
    reply: ReplyFuture | ReplyStream | None = None
    control: bool = False


class Mailbox:
    def __init__(self, name: str, accepts: tuple[type[msgspec.Struct], ...], capacity: int) -> None:
        if capacity < 1:
            raise ValueError("mailbox capacity must be >= 1")
        self.name = name
        self.accepts = accepts
        self.capacity = capacity
        self._room = anyio.Semaphore(capacity)
        self._send, self._recv = anyio.create_memory_object_stream[Envelope](math.inf)
        self._closed = False

    def check(self, msg: object) -> None:
        if not isinstance(msg, self.accepts):
            names = ", ".join(t.__name__ for t in self.accepts)
            raise TypeError(f"{self.name} accepts {names}; got {type(msg).__name__}")

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return self._send.statistics().current_buffer_used

    async def put(self, env: Envelope) -> None:
        """Queue a message; waits while the mailbox is full."""
        self.check(env.msg)
        if self._closed:
            raise ActorStopped(self.name)
        await self._room.acquire()
        if self._closed:
            self._room.release()
            raise ActorStopped(self.name)
        self._send.send_nowait(env)

    def try_put(self, env: Envelope) -> bool:
        """Queue a message if there is room now (for senders that must not wait); False if not."""
        self.check(env.msg)
        if self._closed:
            return False
        try:
            self._room.acquire_nowait()
        except anyio.WouldBlock:
            return False
        self._send.send_nowait(env)
        return True

    def put_control(self, env: Envelope) -> None:
        """Queue a control envelope without waiting for room."""
        if self._closed:
            return
        env.control = True
        self._send.send_nowait(env)

    async def get(self) -> Envelope:
        env = await self._recv.receive()
        if not env.control:
            self._room.release()
        return env

    def get_nowait(self) -> Envelope | None:
        try:
            env = self._recv.receive_nowait()
        except anyio.WouldBlock:
            return None
        if not env.control:
            self._room.release()
        return env

    def close(self) -> list[Envelope]:
        """Refuse new messages; return the ones still queued so their senders can be answered."""
        self._closed = True
        left: list[Envelope] = []
        while (env := self.get_nowait()) is not None:
            left.append(env)
        return left

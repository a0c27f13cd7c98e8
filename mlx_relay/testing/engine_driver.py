"""A BatchEngine stepped by hand on the calling thread, collecting each request's events (tests).

Run it through a GPUThread (the `gpu` fixture) so MLX work stays on one thread.
"""

from __future__ import annotations

from typing import Any

from mlx_relay.engine.batch_engine import BatchEngine
from mlx_relay.engine.messages import Finished, Generate, PromptScored, SnapshotTaken, TokenDelta


class Driver:
    """A BatchEngine (prefix cache on unless told otherwise); `run` steps it until it drains."""

    def __init__(self, loaded: Any, **kw: Any) -> None:
        self.events: list[Any] = []
        args = {"max_num_seqs": 8, "prefill_batch_size": 4, "prefill_step_size": 16, "seed": 0,
                "mtp_max_batch": 8, "prefix_cache": True} | kw
        self.engine = BatchEngine(loaded, emit=self.events.extend, **args)
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, Finished] = {}
        self.snapshots: dict[int, list[SnapshotTaken]] = {}
        self.scored: dict[str, PromptScored] = {}
        self.steps = 0
        self._sid = 0

    def add(self, req: Generate) -> int:
        sid = self._sid
        self._sid += 1
        self.tokens[sid], self.snapshots[sid] = [], []
        self.engine.add(sid, req)
        return sid

    def step(self) -> None:
        self.engine.step()
        self.steps += 1
        for sid, ev in self.events:
            if isinstance(ev, TokenDelta):
                self.tokens[sid] += ev.token_ids
            elif isinstance(ev, Finished):
                self.finished[sid] = ev
            elif isinstance(ev, SnapshotTaken):
                self.snapshots[sid].append(ev)
            elif isinstance(ev, PromptScored):
                self.scored[ev.request_id] = ev
            else:
                raise ev
        self.events.clear()

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work:
                return
            self.step()
        raise AssertionError("engine did not drain")

"""An EngineCore stepped by hand on the calling thread, collecting each request's events (tests).

Run it through a GPUThread (the `gpu` fixture) so MLX work stays on one thread. Text requests
get the TextMTPExecutor's real plan (MTP where the policy says so), as the service gives them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mlx_relay.actors.text_mtp_executor import TextMTPExecutor
from mlx_relay.config import EngineConfig
from mlx_relay.engine.step.core import EngineCore
from mlx_relay.messages.gpu import Finished, Generate, TokenDelta
from mlx_relay.messages.prefix_cache import SnapshotTaken
from mlx_relay.messages.specprefill import ScoringOutcome
from mlx_relay.messages.text_mtp import PlanText


class Driver:
    """An EngineCore (prefix cache on unless told otherwise); `run` steps it until it drains.
    Keyword arguments are EngineConfig fields (`draft_model`: speculative decoding's draft), plus
    `prefix_cache` and `specprefill_draft` (SpecPrefill's draft). Decode
    priority is off unless asked (`decode_stall_factor`): it schedules prefill by measured time,
    so the steps a test counts would vary with the machine's load. Speculation is the head's alone
    unless asked (`speculation`), every round verifying it unless asked (`context_policy` "always"):
    under "auto" a round's source, and whether the head is weighed off, are chosen by measured time."""

    def __init__(self, loaded: Any, *, prefix_cache: bool = True, specprefill_draft: str | None = None,
                 **kw: Any) -> None:
        fields = {"max_num_seqs": 8, "prefill_batch_size": 4, "prefill_step_size": 16, "seed": 0,
                  "mtp_max_batch": 8, "decode_stall_factor": 0, "speculation": "mtp", "context_policy": "always"} | kw
        self.config = EngineConfig(model_path=loaded.info.model_path, **fields)
        self.engine = EngineCore(loaded, self.config, prefix_cache=prefix_cache, draft_model=specprefill_draft)
        self.policy = TextMTPExecutor(self.config, msgspec.structs.replace(
            loaded.info, speculative_draft=self.engine.speculative_draft))
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, Finished] = {}
        self.snapshots: dict[int, list[SnapshotTaken]] = {}
        self.scored: dict[str, ScoringOutcome] = {}
        self.steps = 0
        self._sid = 0
        self._by_request: dict[str, int] = {}

    @property
    def mtp_block(self) -> int | None:
        """The block size MTP rows must ask for (None: this engine has no MTP lane)."""
        return self.engine.scheduler.mtp_block

    def planned(self, req: Generate) -> Generate:
        """The request with the TextMTPExecutor's plan (text requests without one)."""
        if req.vision is not None or req.speculate is not None:
            return req
        plan = self.policy.plan(PlanText(req.request_id, req.sampling,
                                         sparse=req.sparse is not None or req.score is not None))
        return msgspec.structs.replace(req, speculate=plan.speculate) if plan.speculate is not None else req

    def add(self, req: Generate) -> int:
        req = self.planned(req)
        sid = self._sid
        self._sid += 1
        self.tokens[sid], self.snapshots[sid] = [], []
        self._by_request[req.request_id] = sid
        self.engine.add(sid, req)
        return sid

    def step(self) -> None:
        out = self.engine.step()
        self.steps += 1
        for sid, ev in out.events:
            if isinstance(ev, TokenDelta):
                self.tokens[sid] += ev.token_ids
            elif isinstance(ev, Finished):
                self.finished[sid] = ev
            else:
                raise ev
        for snap in out.snapshots:
            self.snapshots[self._by_request[snap.request_id]].append(snap)
        for outcome in out.scored:
            self.scored[outcome.request_id] = outcome

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_work:
                return
            self.step()
        raise AssertionError("engine did not drain")

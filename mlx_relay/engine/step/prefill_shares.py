"""Each lane's prefill tokens in a step (pure, no MLX; the engine core asks once a step, `core.py`).

    shares = PrefillShares(token_budget, priority)
    split = shares.split(decode, prefilling, finishing_costs)   # per lane, in the lanes' order
    shares.observe(seconds, prefill_tokens)                     # the step's measured duration

The step's token budget less every lane's decoding tokens (`scheduling/token_budget.py`), within
decode priority's allowance while rows decode and prompts wait (`interleave.py`, told the fewest
tokens with which a waiting prompt finishes), split over the
lanes by the rows each has prefilling; or, every other step at most, all of it to prompts that
finish in it (`token_budget.finishing_shares`: their first tokens come out of that step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlx_relay.engine.scheduling.token_budget import finishing_shares, prefill_budget, split_by_rows
from mlx_relay.engine.step.interleave import DecodePriority


@dataclass
class PrefillShares:
    token_budget: int  # a step's tokens, decoding rows first (`token_budget.step_budget`)
    priority: DecodePriority | None  # None: prefill takes what the budget leaves
    last_budget: tuple[int, int] = (0, 0)  # the last step's decoding tokens and the prefill it allowed
    finishing_steps: int = 0  # steps that ran only prompts they finished
    finished_last: bool = False  # the last step was one (the next is an ordinary step)

    def split(self, decode: int, prefilling: list[int], finishing_costs: Callable[[], list[list[int]]]) -> list[int]:
        """Per lane: its prefill tokens this step. `decode`: every lane's decoding tokens;
        `prefilling`: each lane's rows whose prefill would run; `finishing_costs`: each lane's
        `Lane.finishing_costs` (asked when decode priority holds the prefill, or when two or more
        rows prefill and prefill runs)."""
        budget = prefill_budget(self.token_budget, decode)
        costs: list[list[int]] | None = None
        if self.priority is not None and decode and any(prefilling):
            costs = finishing_costs()
            budget = self.priority.allowance(budget, min((c for lane in costs for c in lane if c > 0), default=None))
        self.last_budget = (decode, budget)
        rows = sum(prefilling)
        finishing = None if self.finished_last or budget <= 0 or rows < 2 else finishing_shares(
            costs if costs is not None else finishing_costs(), budget, rows)
        self.finished_last = finishing is not None
        self.finishing_steps += self.finished_last
        return finishing or split_by_rows(prefilling, budget)

    def observe(self, seconds: float, prefill_tokens: int) -> None:
        """The step's duration and the prefill tokens it ran (decode priority's cost model)."""
        if self.priority is not None:
            self.priority.observe(seconds, self.last_budget[0], prefill_tokens)

"""Decode-priority interleaving (pure, no MLX): how much prefill an engine step may run while rows decode.

The step's token budget (`token_budget.py`) bounds the prefill tokens a step runs beside the
decoding rows, but not what they cost: on the CPU backend a step that prefills even 64 tokens
costs ~30x a decode step (a decode round ~12 ms, prefill ~3-5 ms a token plus ~30 ms a call for
mlx-vlm's 64-padded GatedDeltaNet solve), so a stream decoding beside long prompts gets a token
every few hundred milliseconds however small the budget (issue 30.6,
`benchmarks/results/short-behind-long-cpu-2026-11-26/`).

`DecodePriority` holds prefill to a share of the time instead, from the engine's own measured
costs: with a stall factor F, while rows decode, the prefill run beside them may take at most
(F - 1) times the time the decode steps take, so a decoding row's inter-token latency stays
within about F times its latency alone, and the prompts still get (F - 1) / F of the time:
- `decode_s`: a step that only decodes (an exponential average of their durations);
- `token_s`: a prompt token of prefill (the step's time less `decode_s`, per prefill token);
- a credit in seconds: each step in which rows decode and prompts wait adds (F - 1) x
  `decode_s`, capped at one step's credit or `min_chunk` tokens' cost, whichever is more (so
  the prefill comes as small chunks spread over the steps, never as a saved-up burst);
  the prefill a step runs is charged at its measured cost (so a chunk that cost more than
  estimated is paid back by the steps after it; a debt of `DEBT_CHUNKS` chunks' worth at most).
A step runs as many prefill tokens as its credit buys (at most the budget), none when that is
fewer than `min_chunk` (the credit carries to the next step): prefill runs every step when
chunks are cheap, every Nth step when they are not. When no row decodes, the prompts get the
whole budget every step, as before. Until the decode step is measured, a step holds prefill back
(and so measures it; again after `REMEASURE` steps in a row that prefilled, as the decoding rows
change); until the prefill is, a step runs `min_chunk` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the stall factor's default per backend (EngineConfig.decode_stall_factor None): on CPU below the
#: issue's target (a stream's ITL within 3x of alone while long prompts prefill), as the server's
#: own work between steps shares the cores (3 measured 3.6x for a 64-token stream,
#: benchmarks/results/short-behind-long-cpu-2026-11-26b/); on a GPU off until the GPU probe
#: (benchmarks/gpu/device_short_behind_long.sh) measures one against the long prompt's TTFT
DEFAULT_FACTOR = {"cpu": 2.5}
SMOOTHING = 0.25  # the weight of the newest measurement in the cost averages
DEBT_CHUNKS = 4  # the most debt the prefill may run up, in chunks' worth of credit
REMEASURE = 32  # steps in a row that prefill beside decoding rows before one measures the decode alone


@dataclass
class DecodePriority:
    factor: float  # F > 1: a decoding row's steps take at most about F times a decode step
    min_chunk: int = 16  # the fewest prefill tokens worth a step (fewer: the credit carries on)
    decode_s: float | None = None
    token_s: float | None = None
    credit_s: float = 0.0
    held: int = 0  # steps whose prefill was held back (rows decoding, prompts waiting)
    since_decode: int = 0  # steps since the last that only decoded

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError("the decode stall factor must be more than 1")

    def allowance(self, budget: int) -> int:
        """The prefill tokens of a step in which rows decode and prompts wait, out of `budget`
        (what the token budget leaves); 0 holds the prefill back this step."""
        floor = min(self.min_chunk, budget)
        if self.decode_s is None or self.since_decode >= REMEASURE:
            self.held += 1
            return 0  # measure a decode step
        if self.token_s is None or self.token_s <= 0:
            return floor  # measure the prefill
        earned = (self.factor - 1) * self.decode_s
        self.credit_s = min(self.credit_s + earned, max(earned, self.min_chunk * self.token_s))
        tokens = min(budget, int(self.credit_s / self.token_s + 1e-6))
        if tokens < floor:
            self.held += 1
            return 0
        return tokens

    def observe(self, seconds: float, decode_tokens: int, prefill_tokens: int) -> None:
        """A step's measured duration, with the decoding rows' tokens and the prefill tokens it ran."""
        if prefill_tokens <= 0:
            if decode_tokens > 0:
                self.decode_s = _average(self.decode_s, seconds)
                self.since_decode = 0
            return
        self.since_decode += 1
        prefill_s = max(0.0, seconds - ((self.decode_s or 0.0) if decode_tokens > 0 else 0.0))
        if decode_tokens <= 0:
            self.credit_s = min(self.credit_s, 0.0)  # nothing decoded: no saved credit (a debt stays)
            return
        # the cost of a token in the chunks run beside decoding rows (a prompt alone runs larger
        # ones, cheaper per token); a chunk of a few tokens costs mostly the call's own
        if prefill_tokens >= self.min_chunk:
            self.token_s = _average(self.token_s, prefill_s / prefill_tokens)
        if self.decode_s is not None and self.token_s is not None:
            # the debt at most a few chunks' worth (a one-off slow step, a compile, does not hold
            # the prompts back for long)
            cap = max((self.factor - 1) * self.decode_s, self.min_chunk * self.token_s)
            self.credit_s = max(self.credit_s - prefill_s, -DEBT_CHUNKS * cap)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def decode_priority(configured: float | None, backend: str, min_chunk: int) -> DecodePriority | None:
    """The engine's policy: the configured factor (0: off), else the backend's default (none: off)."""
    factor = DEFAULT_FACTOR.get(backend) if configured is None else configured
    if not factor:
        return None
    return DecodePriority(factor=factor, min_chunk=min_chunk)

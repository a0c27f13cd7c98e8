"""Decode-priority interleaving (pure, no MLX): how much prefill an engine step may run while rows decode.

The step's token budget (`scheduling/token_budget.py`) bounds the prefill tokens a step runs beside the
decoding rows, but not what they cost: on the CPU backend a step that prefills even 64 tokens
costs ~30x a decode step (a decode round ~12 ms, prefill ~3-5 ms a token plus ~30 ms a call for
mlx-vlm's 64-padded GatedDeltaNet solve, which the CPU's prefill no longer runs:
`kernels/gated_delta_cpu.py`), so a stream decoding beside long prompts gets a
token every few hundred milliseconds however small the budget (issue 30.6,
`benchmarks/results/short-behind-long-cpu-2026-11-26/`).

`DecodePriority` holds prefill to a share of the time instead, from the engine's own measured
costs: with a stall factor F, while rows decode, the prefill run beside them may take at most
(F - 1) times the time the decode steps take, so a decoding row's inter-token latency stays
within about F times its latency alone, and the prompts still get (F - 1) / F of the time:
- `decode_s`: a step that only decodes (an exponential average of their durations);
- `cost`: a prefill chunk's time as a line, fixed + tokens x per token (`ChunkCost`), fitted to
  the chunks the engine ran (their time less `decode_s` when rows decoded beside them), beside
  decoding rows or alone, averaged per size class so the large chunks a prompt alone runs keep
  their weight beside the many small ones. The fixed part is what a chunk costs before its first
  token (on an H200 ~60 ms for the 35B-A3B shape: a 256-token chunk 74-88 ms against ~0.11 ms a
  token beyond, `benchmarks/results/prefill-h200-2026-11-28/`), so a chunk priced by its tokens
  alone ran 16 tokens a time there, nearly all fixed cost: a 30K prompt 36x slower beside streams;
- a credit in seconds: each step in which rows decode and prompts wait adds (F - 1) x
  `decode_s`, capped at one step's credit or the cost of the smallest chunk worth its fixed cost
  (`EFFICIENT`: the fixed part at most a quarter of it), whichever is more (so the prefill comes
  as chunks spread over the steps, never as a saved-up burst), or of a waiting prompt's whole
  remainder where that is less (`finishing`: a short prompt is not held back for credit worth a
  chunk it has no tokens to fill; on an H200, credit for ~1,600 tokens held every short_chat prompt
  at c=16 for ~14 steps, its TTFT 5.3x, `benchmarks/results/gpu-h200-2026-11-29g/`); the prefill a step runs is charged
  at its measured cost (so a chunk that cost more than estimated is paid back by the steps after
  it; a debt of `DEBT_CHUNKS` chunks' worth at most).
A step runs as many prefill tokens as its credit buys (at most the budget), none while that is
fewer than the smallest efficient chunk (the credit carries to the next step): prefill runs every
step when chunks are cheap, every Nth step when they are not. When no row decodes, the prompts get the
whole budget every step, as before. Until the decode step is measured, a step holds prefill back
(and so measures it; again after `REMEASURE` steps in a row that prefilled, as the decoding rows
change); until a chunk is, a step runs `min_chunk` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: the stall factor's default per backend (EngineConfig.decode_stall_factor None): on CPU below the
#: issue's target (a stream's ITL within 3x of alone while long prompts prefill), as the server's
#: own work between steps shares the cores (3 measured 3.6x for a 64-token stream,
#: benchmarks/results/short-behind-long-cpu-2026-11-26b/); on a GPU off: on an H200, 2 held 8 streams at 1.45x
#: beside a 30K prompt (its TTFT 3.14x; off: 27-35x, 1.0x) but served short_chat at 0.78x / 0.85x the out
#: tokens at c=16 / c=64, each short prompt held for a long prompt's chunk (gpu-h200-2026-11-29f and -29g),
#: before a prompt that can finish waited only for its own cost: to be served again
DEFAULT_FACTOR = {"cpu": 2.5}
SMOOTHING = 0.25  # the weight of the newest measurement in the cost averages
DEBT_CHUNKS = 4  # the most debt the prefill may run up, in chunks' worth of credit
REMEASURE = 32  # steps in a row that prefill beside decoding rows before one measures the decode alone


#: a chunk worth running beside decoding rows: its fixed cost at most 1 / (1 + EFFICIENT) of it
EFFICIENT = 3.0


@dataclass
class ChunkCost:
    """A prefill chunk's seconds as fixed + tokens x per_token: least squares over size classes
    (powers of two), each class an exponential average of the chunks of its size measured."""

    classes: dict[int, tuple[float, float]] = field(default_factory=dict)  # class -> (tokens, seconds)

    def add(self, tokens: int, seconds: float) -> None:
        key = max(1, tokens).bit_length()
        old = self.classes.get(key)
        self.classes[key] = (float(tokens), seconds) if old is None else (
            _average(old[0], float(tokens)), _average(old[1], seconds))

    @property
    def measured(self) -> bool:
        return bool(self.classes)

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds a token). One size class measured, or a fit that says a token
        costs nothing: through the origin (no fixed part)."""
        points = list(self.classes.values())
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx_) ** 2 for x in xs)
        if len(points) > 1 and var > 0:
            slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            if slope > 0:
                fixed = my - slope * mx_
                if fixed >= 0:
                    return fixed, slope
                # a negative intercept: a line through the origin and the largest chunk (no fixed part)
        x, y = max(points)
        return 0.0, y / max(x, 1.0)

    def seconds(self, tokens: int) -> float:
        fixed, per_token = self.line()
        return fixed + tokens * per_token


@dataclass
class DecodePriority:
    factor: float  # F > 1: a decoding row's steps take at most about F times a decode step
    min_chunk: int = 16  # the fewest prefill tokens worth a step (fewer: the credit carries on)
    decode_s: float | None = None
    cost: ChunkCost = field(default_factory=ChunkCost)
    credit_s: float = 0.0
    held: int = 0  # steps whose prefill was held back (rows decoding, prompts waiting)
    since_decode: int = 0  # steps since the last that only decoded

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError("the decode stall factor must be more than 1")

    def smallest_chunk(self, budget: int, line: tuple[float, float] | None = None) -> int:
        """The fewest prefill tokens worth a step beside decoding rows: `min_chunk`, or more where a
        chunk's fixed cost would be over a quarter of it (within `budget`); `line`: the cost's, if
        the caller has it."""
        fixed, per_token = line or self.cost.line()
        efficient = int(EFFICIENT * fixed / per_token + 0.999) if per_token > 0 else 0
        return min(budget, max(self.min_chunk, efficient))

    def allowance(self, budget: int, finishing: int | None = None) -> int:
        """The prefill tokens of a step in which rows decode and prompts wait, out of `budget`
        (what the token budget leaves); 0 holds the prefill back this step. `finishing`: the
        fewest tokens with which a waiting prompt's prefill ends (none known: None); a step
        that runs that many is worth its fixed cost, however small."""
        if self.decode_s is None or self.since_decode >= REMEASURE:
            self.held += 1
            return 0  # measure a decode step
        if not self.cost.measured:
            return min(self.min_chunk, budget)  # measure a chunk
        fixed, per_token = line = self.cost.line()  # (fitted once a step)
        smallest = self.smallest_chunk(budget, line)
        if finishing is not None and 0 < finishing < smallest:
            smallest = finishing
        earned = (self.factor - 1) * self.decode_s
        self.credit_s = min(self.credit_s + earned, max(earned, fixed + smallest * per_token))
        tokens = min(budget, int((self.credit_s - fixed) / per_token + 1e-6)) if per_token > 0 else budget
        if tokens < smallest:
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
        if decode_tokens <= 0:  # a prompt alone: its chunk's cost; no saved credit (a debt stays)
            self.cost.add(prefill_tokens, seconds)
            self.credit_s = min(self.credit_s, 0.0)
            return
        self.since_decode += 1
        prefill_s = max(0.0, seconds - (self.decode_s or 0.0))
        self.cost.add(prefill_tokens, prefill_s)
        if self.decode_s is not None:
            # the debt at most a few chunks' worth (a one-off slow step, a compile, does not hold
            # the prompts back for long)
            cap = max((self.factor - 1) * self.decode_s, self.cost.seconds(self.min_chunk))
            self.credit_s = max(self.credit_s - prefill_s, -DEBT_CHUNKS * cap)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def decode_priority(configured: float | None, backend: str, min_chunk: int) -> DecodePriority | None:
    """The engine's policy: the configured factor (0: off), else the backend's default (none: off)."""
    factor = DEFAULT_FACTOR.get(backend) if configured is None else configured
    if not factor:
        return None
    return DecodePriority(factor=factor, min_chunk=min_chunk)

"""The values of a random-weight benchmark model whose MTP head agrees with it at a set rate
(issue 17.5): what `build_random_model.py --mtp-agree RATE` puts in place of random draws, and the
checks it runs on the quantized result before saving.

Construction (hidden size d, vocabulary V; every layer, expert and projection keeps its full shape
and is computed as usual, only values are chosen):

* a cycle: the regular tokens (no added/special token, no padding row) in a seeded random order
  `x_0 -> x_1 -> ... -> x_{L-1} -> x_0`, L ~ 248K, trimmed to a multiple of the pattern's period;
* agreement per cycle position, deterministic: position i agrees iff `i mod (2a+b) < 2a`, with
  `a/(a+b)` the RATE as a small fraction (0.6 = 3/5, 0.75 = 3/4, 0.8 = 4/5);
* embeddings: N(0, 1) rows; an agreeing token keeps only the first d/2 coordinates, a disagreeing
  one only the last d/2 (tokens off the cycle keep all d);
* lm_head: the row of `x_{i+1}` is `embed(x_i) / sqrt(d)`, every other row zero, so the target's
  greedy next token is `x_{i+1}` with a logit margin of about sqrt(d/2) standard deviations of the
  competitors (32 at d = 2048) -- the fixtures' `bigram` idea with the bigram a chosen long cycle;
* target layers: the residual branches' output projections (attention `o_proj`, GatedDeltaNet
  `out_proj`, the experts' and the shared expert's `down_proj`) drawn at 0.02 / sqrt(fan_in), so
  the residual stream stays ~ embed(x) and the prediction is the bigram up to small noise;
* MTP head: `fc = [P | 0]` with `P = diag(+1 (d/2 times), -1 (d/2 times))`, its layer's output
  projections scaled like the target's: for an agreeing token the head's hidden is ~ embed(x) and
  it drafts the target's next token; for a disagreeing one it is ~ -embed(x), whose true
  successor gets the lowest logit, and the draft is some other token, always rejected.

Why the pattern is runs: at block 2 a round drafts from the last emitted token c = x_i; if i agrees
the draft is accepted and the next round starts at x_{i+2}, else at x_{i+1}. Runs of 2a agreeing
positions then b disagreeing ones give, from any entry point, exactly a accepted rounds out of a+b
per period once the chain has passed one run of disagreeing positions (the rounds then start at
each run's first position), so the acceptance measured over ~100 tokens is RATE within a round or
two, where independent per-token draws would spread by +-0.05. (At block > 2 the head drafts from
its own drafts and this pattern's acceptance is not RATE: the rate is calibrated for block 2.)
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

#: Output projections of the residual branches (names end with one of these).
RESIDUAL_OUT_SUFFIXES = (".self_attn.o_proj.weight", ".linear_attn.out_proj.weight",
                         ".mlp.switch_mlp.down_proj.weight", ".mlp.shared_expert.down_proj.weight",
                         ".mlp.down_proj.weight")  # the last: a dense draft's MLP
#: Their gain: N(0, (gain / sqrt(fan_in))^2).
RESIDUAL_GAIN = 0.02
#: Largest period denominator a RATE is approximated with.
MAX_DENOMINATOR = 20


@dataclass(frozen=True)
class AgreePlan:
    """The cycle and the agreement pattern along it."""

    rate: float  # as asked
    a: int  # accepted rounds per period
    b: int  # rejected rounds per period
    order: np.ndarray  # token ids in cycle order, int64, length a multiple of `period`

    @property
    def period(self) -> int:
        return 2 * self.a + self.b

    @property
    def design_rate(self) -> float:
        return self.a / (self.a + self.b)

    def agrees(self) -> np.ndarray:
        """Per cycle position: does the head draft the target's next token from this token."""
        return (np.arange(len(self.order)) % self.period) < 2 * self.a

    def successors(self) -> np.ndarray:
        return np.roll(self.order, -1)


def make_plan(rate: float, n_regular: int, seed: int) -> AgreePlan:
    """The plan for `rate` (0 < rate <= 1) over token ids 0 .. n_regular - 1."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"--mtp-agree must be in (0, 1], got {rate}")
    frac = Fraction(rate).limit_denominator(MAX_DENOMINATOR)
    if frac == 0:
        frac = Fraction(1, MAX_DENOMINATOR)
    a, b = frac.numerator, frac.denominator - frac.numerator
    period = 2 * a + b
    length = n_regular - n_regular % period
    order = np.random.default_rng(seed).permutation(n_regular)[:length].astype(np.int64)
    return AgreePlan(rate, a, b, order)


def block2_acceptance(agrees: np.ndarray, start: int = 0, skip: int = 0) -> tuple[int, int]:
    """(accepted, rounds) of block-2 rounds walking `agrees` from `start` to its end (an accepted
    round moves two positions, a rejected one one); the first `skip` rounds are not counted."""
    i, acc, rounds = start, 0, 0
    n = len(agrees)
    while i < n:
        ok = bool(agrees[i])
        if rounds >= skip:
            acc += ok
        rounds += 1
        i += 2 if ok else 1
    return acc, max(rounds - skip, 0)


# ----------------------------------------------------------------------------- values (MLX)


def residual_out_value(shape: tuple[int, ...], dtype: Any) -> Any:
    import mlx.core as mx

    return (mx.random.normal(shape) * (RESIDUAL_GAIN / float(np.sqrt(shape[-1])))).astype(dtype)


def embed_and_head(plan: AgreePlan, vocab: int, hidden: int, dtype: Any) -> tuple[Any, Any]:
    """(embed_tokens.weight, lm_head.weight), both [vocab, hidden], evaluated."""
    import mlx.core as mx

    if hidden % 2:
        raise ValueError("--mtp-agree needs an even hidden size")
    half = hidden // 2
    agrees = plan.agrees()
    keep_first = np.ones(vocab, dtype=bool)
    keep_last = np.ones(vocab, dtype=bool)
    keep_first[plan.order[~agrees]] = False
    keep_last[plan.order[agrees]] = False
    cols = mx.arange(hidden)[None, :] < half
    mask = mx.where(cols, mx.array(keep_first)[:, None], mx.array(keep_last)[:, None])
    embed = (mx.random.normal((vocab, hidden)) * mask).astype(dtype)
    mx.eval(embed)
    head = mx.zeros((vocab, hidden), dtype=dtype)
    order, succ = mx.array(plan.order), mx.array(plan.successors())
    head[succ] = (embed[order].astype(mx.float32) / float(np.sqrt(hidden))).astype(dtype)
    mx.eval(head)
    return embed, head


def draft_embed_and_head(plan: AgreePlan, vocab: int, hidden: int, dtype: Any) -> tuple[Any, Any]:
    """A draft model's (embed_tokens.weight, lm_head.weight) for the target of the same cycle (issue
    45.1: `build_random_model.py --shape draft --agree-with RATE`): N(0, 1) embeddings, and the
    head's row of the token it drafts after `x_i` is `embed(x_i) / sqrt(d)`: the target's next
    token `x_{i+1}` where `plan` agrees at position i, else `x_{i+2}` (a token the target does not
    write there); rows that two positions point at hold the sum (the other's term is noise)."""
    import mlx.core as mx

    embed = mx.random.normal((vocab, hidden)).astype(dtype)
    mx.eval(embed)
    drafted = np.where(plan.agrees(), plan.successors(), np.roll(plan.order, -2))
    rows = (embed[mx.array(plan.order)].astype(mx.float32) / float(np.sqrt(hidden)))
    head = mx.zeros((vocab, hidden), dtype=mx.float32).at[mx.array(drafted)].add(rows).astype(dtype)
    mx.eval(head)
    return embed, head


def fc_value(hidden: int, dtype: Any) -> Any:
    """The MTP head's fc, [hidden, 2 * hidden]: [diag(+1.., -1..) | 0] (the target hidden unused)."""
    import mlx.core as mx

    half = hidden // 2
    sign = mx.concatenate([mx.ones((half,)), -mx.ones((hidden - half,))])
    return mx.concatenate([mx.diag(sign), mx.zeros((hidden, hidden))], axis=1).astype(dtype)


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class ChainCheck:
    positions: int
    bigram_ok: float  # target (embedding -> final norm -> lm_head) predicts the successor
    head_as_planned: float  # the head agrees exactly where planned (with its layer, teacher-forced)
    target_ok: float  # the whole target (all layers, teacher-forced prefill) predicts the successor
    acceptance: float  # block-2 acceptance walking the head's measured agreement along the window

    def line(self) -> str:
        return (f"mtp-agree check over {self.positions} cycle positions: target bigram {self.bigram_ok:.4f}, "
                f"whole target {self.target_ok:.4f}, head agrees as planned {self.head_as_planned:.4f}, "
                f"block-2 acceptance {self.acceptance:.3f}")


def head_weight(lm: Any) -> Any:
    """The lm_head's weight as the model uses it, dequantized when quantized, in float32 (the
    checks' matmuls then run at dense speed: the CPU's quantized matmul takes ~50 ms a row)."""
    import mlx.core as mx

    head = lm.lm_head
    if hasattr(head, "scales"):
        return mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits).astype(mx.float32)
    return head.weight.astype(mx.float32)


def _argmax_chunks(weight: Any, hidden: Any, chunk: int = 256) -> np.ndarray:
    """argmax(hidden @ weight.T) per row, in chunks; on the CPU through numpy's BLAS (MLX's CPU
    matmul is ~100x slower there)."""
    import mlx.core as mx

    on_cpu = mx.default_device() == mx.cpu
    w_host = np.array(weight) if on_cpu else None
    out = []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk].astype(mx.float32)
        if w_host is not None:
            out.append(np.argmax(np.array(h) @ w_host.T, axis=-1))
            continue
        ids = mx.argmax(h @ weight.T, axis=-1)
        mx.eval(ids)
        out.append(np.array(ids))
    return np.concatenate(out)


def check_chain(lm: Any, head: Any, plan: AgreePlan, *, positions: int = 2048, prefill: int = 128,
                start: int = 0) -> ChainCheck:
    """The quantized model on a window of the cycle: the bigram through embedding, final norm and
    lm_head; the MTP head with its layer (teacher-forced, causal, the target hidden input zero as
    fc ignores it); the whole target on the window's first `prefill` tokens in one prefill."""
    import mlx.core as mx

    weight = head_weight(lm)

    idx = (start + np.arange(positions)) % len(plan.order)
    toks = mx.array(plan.order[idx])
    succ = plan.successors()[idx]
    agrees = plan.agrees()[idx]
    emb = lm.model.embed_tokens(toks)
    bigram = _argmax_chunks(weight, lm.model.norm(emb))
    h = mx.concatenate([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(mx.zeros_like(emb))], axis=-1)
    h = head.fc(h)[None]
    pos = mx.arange(positions)[None]
    for layer in head.layers:
        h = layer(h, mask="causal", cache=None, position_ids=pos)
    drafted = _argmax_chunks(weight, head.norm(h)[0])
    head_ok = drafted == succ
    n = min(prefill, positions)
    target = _argmax_chunks(weight, lm.model(toks[None, :n], cache=lm.make_cache())[0])
    acc, rounds = block2_acceptance(head_ok, skip=plan.a + plan.b)
    return ChainCheck(positions, float(np.mean(bigram == succ)), float(np.mean(head_ok == agrees)),
                      float(np.mean(target == succ[:n])), acc / max(rounds, 1))

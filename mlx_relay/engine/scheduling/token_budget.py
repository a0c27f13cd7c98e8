"""The engine step's token budget (pure functions, no MLX): decodes first, prefill in what is left.

One engine step runs every decoding row once and then prefill chunks; the step lasts as long as
the tokens it runs, so a row that decodes waits, between two of its tokens, for every prompt token
prefilled in that step. As vLLM v1's scheduler does (`max_num_batched_tokens`, chunked prefill),
each step has a budget of tokens: decoding rows are counted first (a plain row 1, an MTP row its
verify block), and prefill chunks get what is left, never less than `MIN_PREFILL_TOKENS` (so
prompts go on however many rows decode). A long prompt is cut into chunks no bigger than its
share, so a running row's next token never waits on a whole long chunk.

Shares: vLLM takes prompts first come first served and caps each long one at
`long_prefill_token_threshold` so that others fit beside it. Here every prefilling row gets an
equal share of the step's prefill budget (`fair_shares`: max-min fair), and a row that needs less
than its share (a short prompt, or a row a snapshot boundary stops early) leaves the rest to the
others. A short prompt that arrives while long ones prefill therefore runs whole in the next
step, beside the long ones' smaller chunks, instead of waiting for their remaining chunks; the
long ones lose only the few tokens it takes, for one step. No threshold is needed: equal shares
bound every row's chunk by the budget over the rows prefilling.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_PREFILL_TOKENS = 16  # the prefill's floor per step (the smallest chunk length of fixed shapes)
# mlx-vlm's chunked GatedDeltaNet prefill (off Metal) pads every call to a multiple of 64 tokens
# and solves each 64-token chunk in 64 sequential steps: a row's share is cut to a multiple of
# this when it is at least this long, so no step pays for a padded chunk it could have filled
PREFILL_GRANULE = 64


def prefill_budget(budget: int, decode_tokens: int) -> int:
    """The tokens prefill may run this step: what decoding rows leave of `budget`, at least
    `MIN_PREFILL_TOKENS` (or the whole budget if it is smaller)."""
    return max(budget - decode_tokens, min(budget, MIN_PREFILL_TOKENS))


def granular(share: int, need: int, granule: int = PREFILL_GRANULE) -> int:
    """A share cut down to a multiple of `granule` when it is at least that and less than the
    row needs (a row that finishes takes what it needs)."""
    return share if share >= need or share < granule else share - share % granule


def fair_shares(needs: Sequence[int], budget: int, granule: int = 1) -> list[int]:
    """Max-min fair split of `budget` tokens over rows that need `needs` tokens each: rows needing
    less than an equal share get all they need, the rest split what is left equally (the
    remainder to the earliest rows), each cut to a multiple of `granule` (`granular`). Every
    row with a need gets at least 1 token, unless `budget` is 0 (the step holds prefill back)."""
    shares = [0] * len(needs)
    left = max(budget, 0)
    if left == 0:
        return shares
    open_rows = sorted((i for i, n in enumerate(needs) if n > 0), key=lambda i: needs[i])
    while open_rows:
        equal = left // len(open_rows)
        small = [i for i in open_rows if needs[i] <= equal]
        if not small:
            extra = left - equal * len(open_rows)
            for j, i in enumerate(sorted(open_rows)):
                shares[i] = granular(max(1, equal + (1 if j < extra else 0)), needs[i], granule)
            break
        for i in small:
            shares[i] = needs[i]
            left -= needs[i]
        open_rows = [i for i in open_rows if i not in small]
    return shares


def shortest_first(needs: Sequence[int], budget: int, granule: int = 1) -> list[int]:
    """`budget` over rows that need `needs` tokens each: rows that fit whole in what is left take
    all they need, shortest first (a prompt that can finish, finishes); the others split the rest
    max-min fair (`fair_shares`), none when nothing is left."""
    shares = [0] * len(needs)
    left, rest = max(budget, 0), []
    for i in sorted(range(len(needs)), key=lambda i: needs[i]):
        if 0 < needs[i] <= left:
            shares[i], left = needs[i], left - needs[i]
        elif needs[i] > 0:
            rest.append(i)
    for i, share in zip(rest, fair_shares([needs[i] for i in rest], left, granule), strict=True):
        shares[i] = share
    return shares


def finishing_shares(costs: Sequence[Sequence[int]], budget: int, prefilling: int) -> list[int] | None:
    """A finishing step: the prompts that can finish in it, cheapest first while they fit in
    `budget` (each lane's `finishing_costs`: the share with which its next step finishes that
    row), run alone, each lane its finishing rows' share and the others none; None (an ordinary
    step) when no prompt can finish within the budget or every one of the `prefilling` rows can. So a short prompt that
    arrives while long ones prefill is prefilled in a step of its own, not beside a full step of
    their chunks (the engine runs one at most every other step: the long ones go on)."""
    ranked = sorted((c, lane) for lane, lane_costs in enumerate(costs) for c in lane_costs if c > 0)
    shares, left, taken = [0] * len(costs), max(budget, 0), 0
    for cost, lane in ranked:
        if cost > left:
            break
        shares[lane], left, taken = shares[lane] + cost, left - cost, taken + 1
    return shares if 0 < taken < prefilling else None


def split_by_rows(rows: Sequence[int], budget: int) -> list[int]:
    """`budget` split over consumers (lanes) in proportion to the rows each has prefilling, so
    every prefilling row gets about the same share whichever lane it is in; a consumer with rows
    gets at least 1 token (none when `budget` is 0: the step holds prefill back)."""
    total = sum(rows)
    if total == 0 or budget <= 0:
        return [0] * len(rows)
    return [max(1, budget * n // total) if n else 0 for n in rows]


CPU_BUDGET = 256  # the CPU backend's default budget (EngineConfig.max_num_batched_tokens): four GatedDeltaNet chunks


def step_budget(configured: int | None, prefill_step_size: int, backend: str, decode_max: int) -> int:
    """The step's token budget: as configured; else on the CPU backend `CPU_BUDGET`, and on a
    GPU no limit beyond the prefill's own (`prefill_step_size` plus `decode_max`, the most
    tokens the decoding rows can take: prefill chunks as long as before the budget existed)."""
    if configured is not None:
        return max(1, configured)
    return CPU_BUDGET if backend == "cpu" else max(1, prefill_step_size) + max(0, decode_max)

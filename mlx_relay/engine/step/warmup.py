"""The engine's warm-up and its MTP calibration, run before traffic (GPU thread only).

`warm_up` compiles the kernels the server uses by running requests through the engine's own step
(prefill and decode, greedy and sampled, batch 1 and 2), then has each lane trace the shapes it
runs at (the plain lane's prefill and decode step, the compiled MTP round), then measures what an
MTP round costs in plain decode steps (`mtp_round_cost`, which the TextMTPExecutor's policy reads).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_relay.messages.gpu import Generate, SamplingParams, Speculate, TokenDelta, WarmupReport

if TYPE_CHECKING:
    from mlx_relay.engine.step.core import EngineCore

log = logging.getLogger(__name__)


def warm_up(core: EngineCore) -> WarmupReport:
    """Compile the kernels the server uses: prefill and decode, greedy and sampled, batch 1
    and 2, then the plain lane's prefill at every (rows, chunk length) shape it runs at (fixed
    shapes; none with exact shapes) and its decode step at every batch size it runs at (up to
    max_num_seqs) and the compiled MTP round at every batch size its cohort runs at (up to
    mtp_max_batch), and where small chunks run compiled parts (a CUDA GPU) the mixed step's and the
    MTP lane's chunks' traces (each lane's seconds logged); then measure what an MTP round costs in
    plain steps. Runs to completion on the calling (GPU) thread before traffic."""
    tic = time.perf_counter()
    prompt = list(range(1, min(64, core.vocab_size - 1)))
    greedy = SamplingParams(max_tokens=8)
    sampled = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=0, max_tokens=8)
    block = core.scheduler.mtp_block
    context = core.config.max_draft_tokens
    speculate = Speculate(block, context=context) if block is not None else None
    for wave, batch in enumerate(([greedy], [greedy, sampled])):
        for j, params in enumerate(batch):
            core.add(-(2 * wave + j + 1), Generate(f"warmup-{wave}-{j}", prompt, params, speculate=speculate))
        while core.has_work:
            core.step()
    # a lone row's round against its plain step (compiled by the waves above); then the lanes' other
    # shapes, last: the MTP lane's warm also forgets what these synthetic rows taught its round plans
    cost = mtp_round_cost(core, prompt) if "mtp" in core.lanes else None
    for name, lane in core.lanes.items():
        rows = core.config.max_num_seqs if name != "mtp" else min(core.config.mtp_max_batch, core.config.max_num_seqs)
        lane_tic = time.perf_counter()
        if said := lane.warm(core.vocab_size, rows):
            log.info("%s lane: %s (%.1fs)", name, said, time.perf_counter() - lane_tic)
    mx.clear_cache()  # the warm-up's buffers, dozens of shapes of them
    return WarmupReport(time.perf_counter() - tic, cost)


def mtp_round_cost(core: EngineCore, prompt: list[int], tokens: int = 32) -> float | None:
    """Seconds per MTP round over seconds per plain decode step, a lone greedy row each way, from its
    first token on (`round_cost` of the steps' durations). None if a row ended too soon to tell."""
    runs = []
    block = core.scheduler.mtp_block
    for speculate in (Speculate(block) if block is not None else None, None):
        core.add(-99, Generate("calibrate", prompt, SamplingParams(max_tokens=tokens), speculate=speculate))
        started, durations, rounds0 = False, [], 0
        while core.has_work:
            tic = time.perf_counter()
            out = core.step()
            if started:
                durations.append(time.perf_counter() - tic)
            elif any(isinstance(ev, TokenDelta) for _, ev in out.events):
                started, rounds0 = True, core.mtp_totals.rounds
        rounds = core.mtp_totals.rounds - rounds0 if speculate is not None else len(durations)
        runs.append((durations, rounds))
    return round_cost(*runs[0], runs[1][0])


def round_cost(round_steps: list[float], rounds: int, plain_steps: list[float]) -> float | None:
    """An MTP round in plain decode steps from the steps' durations: the median step of each (a step
    that met a first-shape trace, hundreds of milliseconds on a GPU, is one outlier, not the mean's
    weight; the warm-up's waves trace the context drafts' round, not the head's alone: on an H200
    the mean read 5-8 plain steps where a round costs 1.2-1.6), the MTP steps scaled to rounds (a
    step may finish no round, or a pipelined one). None with fewer than 4 of either."""
    if rounds < 4 or len(round_steps) < 4 or len(plain_steps) < 4:
        return None
    per_round = statistics.median(round_steps) * len(round_steps) / rounds
    return per_round / statistics.median(plain_steps)

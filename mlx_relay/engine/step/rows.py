"""One request's state inside the engine (GPU thread only), from arrival to its last event.

A `Row` moves through the engine's stages: waiting (the scheduler's queue), scoring (SpecPrefill's
draft, `scoring/stage.py`), running in one lane (`engine/lane.py`), finished. The scheduler owns where a row
is; the output stage (`output.py`) owns its text (detokenizer, stop strings, pending deltas);
the lanes own its device state, keyed by the row's id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlx_relay.chat.output import TokenLogprob
from mlx_relay.engine.lane import LaneName
from mlx_relay.engine.sampling.processors import GrammarMask, LogprobRecorder
from mlx_relay.engine.step.detokenizer import IncrementalDetokenizer, StopMatcher
from mlx_relay.messages.gpu import Generate
from mlx_relay.messages.specprefill import SparsePrefill, SpecPrefillReport


@dataclass
class Row:
    rid: int  # the engine's key for the row (the GPUExecutor's stream id)
    req: Generate
    detok: IncrementalDetokenizer
    stops: StopMatcher
    arrived: float = field(default_factory=time.perf_counter)
    lane: LaneName | None = None  # set when the row joins a lane
    sparse: SparsePrefill | None = None  # SpecPrefill's selection (the request's own, or scored here)
    specprefill: SpecPrefillReport | None = None  # what SpecPrefill did (echoed in Finished)
    generated: int = 0
    first_token_at: float | None = None
    emitted_ids: list[int] = field(default_factory=list)
    recorder: LogprobRecorder | None = None  # when the request asked for logprobs
    grammar: GrammarMask | None = None  # when the request has a grammar
    # text and tokens produced this step, not yet sent
    pending_text: list[str] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    processors: list[Any] = field(default_factory=list)  # the row's logits processors (`logits.py`)

    @property
    def wants_scoring(self) -> bool:
        return self.req.score is not None and self.sparse is None and self.specprefill is None

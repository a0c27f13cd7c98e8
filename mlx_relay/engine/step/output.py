"""The engine's output stage (GPU thread, no MLX): tokens become text and rows end.

For each row's new tokens (`lane.RowTokens`) in order: its logprobs are taken from its recorder,
a grammar in an error state ends it with that error, the token is detokenized (UTF-8 safe) and
stop strings are matched (text that could still become a stop string is held back). A row ends
at a stop string, or where its lane said its sequence ended (end-of-sequence, max_tokens). What
ends is returned as `RowEnd`s for the engine to take out of their lanes (a normal end first takes
the row's turn snapshot); `finish` then writes the row's `Finished`. At the end of a step each
running row's text and tokens so far go out as one `TokenDelta`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mlx_relay.engine.lane import RowTokens
from mlx_relay.engine.protocol import Event
from mlx_relay.engine.step.rows import Row
from mlx_relay.errors import GenerationFailed
from mlx_relay.messages.gpu import Drafts, Finished, TokenDelta
from mlx_relay.runtime.supervision import is_failure


@dataclass
class RowEnd:
    """A row ends this step: with a reason (a stop string, or its lane's `SequenceEnd`), or with an error."""

    row: Row
    reason: str | None  # "stop" / "length"; None: `error`
    error: Exception | None = None
    whole_step: bool = True  # every token the lane produced this step was taken (its state is the row's)


@dataclass
class RowCounts:
    """What the row's lane knows at its end."""

    cached_tokens: int = 0
    drafts: Drafts = field(default_factory=Drafts)


class OutputStage:
    def __init__(self) -> None:
        self.events: list[tuple[int, Event]] = []

    def take(self) -> list[tuple[int, Event]]:
        events, self.events = self.events, []
        return events

    def tokens(self, row: Row, out: RowTokens) -> RowEnd | None:
        """Feed one row's new tokens; an RowEnd when the row ends with them."""
        last = len(out.tokens) - 1
        for i, token in enumerate(out.tokens):
            now = time.perf_counter()
            if row.first_token_at is None:
                row.first_token_at = now
            row.generated += 1
            row.pending_ids.append(token)
            row.emitted_ids.append(token)
            if row.recorder is not None:
                lp = row.recorder.take(token)
                if lp is not None:
                    row.pending_logprobs.append(lp)
            if row.grammar is not None and row.grammar.error is not None:
                return RowEnd(row, None, GenerationFailed(f"the output grammar failed: {row.grammar.error}"))
            try:
                text = row.detok.step(token)
            except BaseException as exc:
                if not is_failure(exc):  # native panics are failures too; control flow is not
                    raise
                return RowEnd(row, None, GenerationFailed(f"could not detokenize token {token}"))
            safe, hit = row.stops.feed(text)
            if safe:
                row.pending_text.append(safe)
            if hit:
                return RowEnd(row, "stop", whole_step=i == last)
            if i == last and out.ended is not None:
                tail = row.stops.flush()
                if tail:
                    row.pending_text.append(tail)
                return RowEnd(row, out.ended)
        return None

    def release(self, row: Row) -> None:
        """The row's text and tokens since the last delta, as one TokenDelta."""
        if row.pending_ids:
            logprobs = row.pending_logprobs if row.recorder is not None else None
            self.events.append((row.rid, TokenDelta("".join(row.pending_text), row.pending_ids, logprobs)))
            row.pending_text, row.pending_ids, row.pending_logprobs = [], [], []

    def finish(self, row: Row, reason: str, counts: RowCounts) -> None:
        self.release(row)
        now = time.perf_counter()
        self.events.append((row.rid, Finished(
            reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(row.req.prompt_tokens),
            completion_tokens=row.generated,
            ttft_s=(row.first_token_at or now) - row.arrived,
            total_s=now - row.arrived,
            drafts=counts.drafts,
            cached_tokens=counts.cached_tokens,
            specprefill=row.specprefill,
            stop_sequence=row.stops.matched if reason == "stop" else None,
        )))

    def fail(self, row: Row, error: Exception) -> None:
        self.events.append((row.rid, error))

"""Messages of the TextMTPExecutor (`actors/text_mtp_executor.py`): whether a text request
decodes with MTP speculative decoding and at what block size, and how its drafts fared."""

from __future__ import annotations

import msgspec

from mlx_relay.messages.gpu import Drafts, SamplingParams, Speculate


class PlanText(msgspec.Struct, frozen=True):
    """Ask: how the text path decodes this request. Reply: TextPlan."""

    request_id: str
    sampling: SamplingParams
    sparse: bool = False  # SpecPrefill prefills it sparsely (its state is not the prompt's: no MTP)


class TextPlan(msgspec.Struct, frozen=True):
    """Decode in the MTP lane, drafting as `speculate` says (the engine's scheduler still admits
    the row there only while the lane has room); None: plainly, for the reason `why`."""

    speculate: Speculate | None = None
    why: str = ""  # why not the head (or not speculation at all), for the logs and stats


class MTPOutcome(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> TextMTPExecutor): one MTP-lane request's verified drafts by source, at
    its end."""

    drafts: Drafts
    rounds: int = 0


class MTPCalibration(msgspec.Struct, frozen=True):
    """Ask (the Relay, after the GPUExecutor's warm-up): what an MTP round costs here, in plain
    decode steps of a lone row."""

    round_cost: float


class GetMTPStats(msgspec.Struct, frozen=True):
    """Ask. Reply: MTPStats."""


class MTPStats(msgspec.Struct, frozen=True):
    enabled: bool  # the checkpoint has a head and the server did not turn MTP off
    block_size: int
    planned: int  # text requests sent to MTP
    declined: int  # text requests decoded plainly (opt-out, logits processors, SpecPrefill)
    requests: int  # MTP requests finished
    rounds: int
    drafted: int
    accepted: int
    round_cost: float | None = None  # an MTP round in plain steps, measured at warm-up
    context_planned: int = 0  # requests planned with context drafts
    context_drafted: int = 0
    context_accepted: int = 0
    draft_planned: int = 0  # requests planned with a draft model's drafts
    draft_drafted: int = 0
    draft_accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

"""Messages of the TextMTPExecutor (`actors/text_mtp_executor.py`): whether a text request
decodes with MTP speculative decoding and at what block size, and how its drafts fared."""

from __future__ import annotations

import msgspec

from mlx_relay.messages.gpu import SamplingParams


class PlanText(msgspec.Struct, frozen=True):
    """Ask: how the text path decodes this request. Reply: TextPlan."""

    request_id: str
    sampling: SamplingParams
    sparse: bool = False  # SpecPrefill prefills it sparsely (its state is not the prompt's: no MTP)


class MTPPlan(msgspec.Struct, frozen=True):
    """Decode with MTP: `block_size` tokens per verify round (1 bonus + block - 1 drafts). The
    engine's scheduler still admits the row to the MTP lane only while the lane has room."""

    block_size: int


class TextPlan(msgspec.Struct, frozen=True):
    mtp: MTPPlan | None = None  # None: plain decoding
    why: str = ""  # why not MTP (for the logs and stats)


class MTPOutcome(msgspec.Struct, frozen=True):
    """Tell (GPUExecutor -> TextMTPExecutor): one MTP request's drafts, at its end."""

    drafted: int
    accepted: int
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

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

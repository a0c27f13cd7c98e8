"""TextMTPExecutor: the text path's policy for MTP speculative decoding.

    ChatService --PlanText--> TextMTPExecutor --> TextPlan (MTP at block k, or plain)
    GPUExecutor --MTPOutcome--> TextMTPExecutor: drafts proposed and accepted, per request
    Relay --MTPCalibration--> TextMTPExecutor: an MTP round's cost in plain steps (warm-up)

A text request can decode with MTP when the checkpoint has an MTP head and the server did not
turn it off, the request allows it, and nothing about it needs what a verify round cannot replay
per drafted position: logits processors (logprobs, penalties, thinking budgets) or a sparse
SpecPrefill state (sampling and an output grammar run inside the round:
`engine/lanes/mtp_grammar.py`). Whether it *should* is measured (`mtp_policy` "auto"): a round of
block k yields 1 + a(k-1) tokens at acceptance a and costs r plain steps (r measured at warm-up,
a lone row each way), so MTP is planned only while (1 + a(k-1)) / r > 1: never where even k
accepted tokens cannot pay for a round, and, once enough drafts were counted, only at an
acceptance that pays, with one request in `EXPLORE_EVERY` still sent to MTP so the acceptance
keeps being measured. "always" plans it wherever it can run. The GPUExecutor executes the plan
(its MTP lane, `engine/lanes/mtp_lane.py`); its scheduler admits the row to that lane only while the
lane has room (`mtp_max_batch`). Requests with images or video take the vision path and never ask.
"""

from __future__ import annotations

from mlx_relay.config import EngineConfig
from mlx_relay.messages.gpu import ModelInfo
from mlx_relay.messages.text_mtp import (
    GetMTPStats,
    MTPCalibration,
    MTPOutcome,
    MTPPlan,
    MTPStats,
    PlanText,
    TextPlan,
)
from mlx_relay.runtime import Actor, ReplyStream

MIN_DRAFTS = 64  # drafts counted before the measured acceptance decides
EXPLORE_EVERY = 16  # while MTP does not pay at the measured acceptance, one request in this many still takes it


class TextMTPExecutor(Actor):
    accepts = (PlanText, MTPOutcome, MTPCalibration, GetMTPStats)
    mailbox_capacity = 4096  # every MTPOutcome should fit: far more than requests in flight

    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.enabled = config.mtp and info.has_mtp and config.mtp_max_batch > 0
        self.round_cost: float | None = None
        self._planned = self._declined = self._requests = self._unpaid = 0
        self._rounds = self._drafted = self._accepted = 0

    async def receive(self, msg: PlanText | MTPOutcome | MTPCalibration | GetMTPStats,
                      stream: ReplyStream | None) -> object:
        match msg:
            case PlanText():
                plan = self.plan(msg)
                if plan.mtp is None:
                    self._declined += 1
                else:
                    self._planned += 1
                return plan
            case MTPOutcome():
                self.count(msg)
                return None
            case MTPCalibration(round_cost=cost):
                self.round_cost = cost
                return None
            case GetMTPStats():
                return MTPStats(self.enabled, self.config.mtp_block_size, self._planned, self._declined,
                                self._requests, self._rounds, self._drafted, self._accepted, self.round_cost)
        raise TypeError(type(msg).__name__)

    def count(self, outcome: MTPOutcome) -> None:
        self._requests += 1
        self._rounds += outcome.rounds
        self._drafted += outcome.drafted
        self._accepted += outcome.accepted

    def plan(self, msg: PlanText) -> TextPlan:
        if not self.enabled:
            return TextPlan(why="this server decodes without MTP")
        if not msg.sampling.mtp:
            return TextPlan(why="the request opted out")
        if msg.sampling.needs_plain_lane:
            return TextPlan(why="logprobs, penalties and thinking budgets run in the plain lane")
        if msg.sparse:
            return TextPlan(why="a sparse SpecPrefill prefill")
        k = self.config.mtp_block_size
        if self.config.mtp_policy == "auto" and self.round_cost is not None:
            r = self.round_cost
            if k / r <= 1.0:
                return TextPlan(why=f"a round costs {r:.2f} plain steps here: {k} tokens per round cannot pay")
            if self._drafted >= MIN_DRAFTS:
                a = self._accepted / self._drafted
                if (1 + a * (k - 1)) / r <= 1.0:
                    self._unpaid += 1
                    if self._unpaid % EXPLORE_EVERY:
                        return TextPlan(why=f"at acceptance {a:.2f} a round of {r:.2f} plain steps does not pay")
        return TextPlan(MTPPlan(k))

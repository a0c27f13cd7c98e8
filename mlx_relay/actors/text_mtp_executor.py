"""TextMTPExecutor: the text path's policy for MTP speculative decoding.

    ChatService --PlanText--> TextMTPExecutor --> TextPlan (MTP at block k, or plain)
    GPUExecutor --MTPOutcome--> TextMTPExecutor: drafts proposed and accepted, per request

A text request decodes with MTP when the checkpoint has an MTP head and the server did not turn
it off, the request allows it, and nothing about it needs what a verify round cannot replay per
drafted position: logits processors (logprobs, penalties, grammars, thinking budgets) or a
sparse SpecPrefill state. The GPUExecutor executes the plan (its MTP lane, `engine/mtp_lane.py`);
its scheduler admits the row to that lane only while the lane has room (`mtp_max_batch`: a
round costs more than a plain step as the batch grows). Acceptance is counted here, per request
as it ends; requests with images or video take the vision path and never ask.
"""

from __future__ import annotations

from mlx_relay.config import EngineConfig
from mlx_relay.messages.gpu import ModelInfo
from mlx_relay.messages.text_mtp import GetMTPStats, MTPOutcome, MTPPlan, MTPStats, PlanText, TextPlan
from mlx_relay.runtime import Actor, ReplyStream


class TextMTPExecutor(Actor):
    accepts = (PlanText, MTPOutcome, GetMTPStats)
    mailbox_capacity = 4096  # every MTPOutcome should fit: far more than requests in flight

    def __init__(self, config: EngineConfig, info: ModelInfo) -> None:
        self.config = config
        self.enabled = config.mtp and info.has_mtp and config.mtp_max_batch > 0
        self._planned = self._declined = self._requests = 0
        self._rounds = self._drafted = self._accepted = 0

    async def receive(self, msg: PlanText | MTPOutcome | GetMTPStats, stream: ReplyStream | None) -> object:
        match msg:
            case PlanText():
                plan = self.plan(msg)
                if plan.mtp is None:
                    self._declined += 1
                else:
                    self._planned += 1
                return plan
            case MTPOutcome():
                self._requests += 1
                self._rounds += msg.rounds
                self._drafted += msg.drafted
                self._accepted += msg.accepted
                return None
            case GetMTPStats():
                return MTPStats(self.enabled, self.config.mtp_block_size, self._planned, self._declined,
                                self._requests, self._rounds, self._drafted, self._accepted)
        raise TypeError(type(msg).__name__)

    def plan(self, msg: PlanText) -> TextPlan:
        if not self.enabled:
            return TextPlan(why="this server decodes without MTP")
        if not msg.sampling.mtp:
            return TextPlan(why="the request opted out")
        if msg.sampling.needs_processors:
            return TextPlan(why="logits processors run in the plain lane")
        if msg.sparse:
            return TextPlan(why="a sparse SpecPrefill prefill")
        return TextPlan(MTPPlan(self.config.mtp_block_size))

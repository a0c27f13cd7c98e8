"""TextMTPExecutor: the text path's policy for speculative decoding in the MTP lane.

    ChatService --PlanText--> TextMTPExecutor --> TextPlan (the lane, with the head's drafts and/or
                                                 drafts copied from the context; or plain)
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
keeps being measured. "always" plans it wherever it can run.

Drafts copied from the request's context (`engine/speculation/context_drafts.py`) cost no model
call: under "auto" they are planned beside the head's for every request that takes the head, and
the lane decides round by round whether a row's proposal is worth verifying instead, from what
that request's drafts earned (`engine/speculation/earnings.py`); "context" (the request's
`speculation.method`, or the server's `--speculation`) plans them alone, for checkpoints without
a head too, where a row whose drafts miss decodes one-token rounds (slower than the plain lane:
benchmarks/results/speculation-2026-11-27). The GPUExecutor executes the plan
(its MTP lane, `engine/lanes/mtp_lane.py`); its scheduler admits the row to that lane only while the
lane has room (`mtp_max_batch`). Requests with images or video take the vision path and never ask.
"""

from __future__ import annotations

from mlx_relay.config import EngineConfig
from mlx_relay.engine.models import served_by_mtp_lane
from mlx_relay.messages.gpu import Drafts, ModelInfo, Speculate
from mlx_relay.messages.text_mtp import (
    GetMTPStats,
    MTPCalibration,
    MTPOutcome,
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
        # the engine's MTP lane: with the checkpoint's head, and/or verifying context drafts; only
        # for a family mlx-vlm loads (`engine/lane_set.py`: a model of no family of ours runs its
        # library's forward in one lane, a dense Qwen3 the plain lane alone)
        lane = config.mtp_max_batch > 0 and served_by_mtp_lane(info.model_type)
        self.has_head = config.mtp and info.has_mtp and lane
        self.has_context = config.max_draft_tokens > 0 and lane and not config.pipeline.enabled
        self.has_draft = info.speculative_draft is not None  # the lane verifies a draft model's drafts
        self.enabled = self.has_head or self.has_context or self.has_draft
        self.round_cost: float | None = None
        self._planned = self._declined = self._requests = self._unpaid = 0
        self._rounds = self._context_planned = self._draft_planned = 0
        self._drafts = Drafts()  # the finished requests' verified drafts by source

    async def receive(self, msg: PlanText | MTPOutcome | MTPCalibration | GetMTPStats,
                      stream: ReplyStream | None) -> object:
        match msg:
            case PlanText():
                plan = self.plan(msg)
                if plan.speculate is None or not plan.speculate.head:
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
                d = self._drafts
                return MTPStats(self.enabled, self.config.mtp_block_size, self._planned, self._declined,
                                self._requests, self._rounds, d.mtp.drafted, d.mtp.accepted, self.round_cost,
                                self._context_planned, d.context.drafted, d.context.accepted,
                                self._draft_planned, d.draft.drafted, d.draft.accepted)
        raise TypeError(type(msg).__name__)

    def count(self, outcome: MTPOutcome) -> None:
        self._requests += 1
        self._rounds += outcome.rounds
        self._drafts += outcome.drafts

    def plan(self, msg: PlanText) -> TextPlan:
        """The request's speculation: the head's drafts where they pay (`_head_pays`), context drafts
        where the request and the server allow them, a draft model's beside them under "auto" (or alone
        for "draft"); the lane picks among them round by round."""
        if not self.enabled:
            return TextPlan(why="this server has no MTP lane (no MTP head, or MTP turned off)")
        sampling = msg.sampling
        method = sampling.speculation or self.config.speculation
        if method == "none":
            return TextPlan(why="speculation is off for the request")
        if sampling.needs_plain_lane:
            return TextPlan(why="logprobs, penalties and thinking budgets run in the plain lane")
        if msg.sparse:
            return TextPlan(why="a sparse SpecPrefill prefill")
        context = 0
        # a seeded sampling request's draws must not depend on the widths the lane picks round by
        # round (timed, and shared with the other rows): it verifies the head's drafts only
        seeded = sampling.seed is not None and sampling.temperature > 0
        if method == "draft":
            return self._draft_plan(msg, seeded)
        if method in ("auto", "context") and sampling.grammar is None and self.has_context and not seeded:
            cap = sampling.max_draft_tokens
            context = self.config.max_draft_tokens if cap is None else min(cap, self.config.max_draft_tokens)
        if method == "context":
            head, why = False, "the request asked for context drafts only"
        elif not self.has_head:
            head, why = False, "the checkpoint has no MTP head (or MTP is off)"
        else:
            head, why = self._head_pays()
        if not sampling.mtp:
            head, why = False, "the request opted out of MTP"
        if method == "auto" and not head:
            # a row in the lane whose drafts miss decodes slower than in the plain lane (one-token
            # rounds: benchmarks/results/speculation-2026-11-27), so under "auto" context drafts
            # ride along with the head's; alone, only where the request or the server asks for them
            context = 0
        if not head and context == 0:
            return TextPlan(why=why)
        if context:
            self._context_planned += 1
        # under "auto" a loaded draft model's drafts ride with the head's and the context's: each round
        # a row verifies the host proposal expected to yield the most (`lanes/round_drafts.py`)
        draft = method == "auto" and head and context > 0 and self.has_draft
        if draft:
            self._draft_planned += 1
        return TextPlan(Speculate(self.config.mtp_block_size, head=head, context=context, draft=draft), why=why)

    def _draft_plan(self, msg: PlanText, seeded: bool) -> TextPlan:
        """The draft model's drafts alone (the lane weighs them round by round as context drafts)."""
        sampling = msg.sampling
        if not self.has_draft:
            return TextPlan(why="no draft model is loaded")
        if sampling.grammar is not None:
            return TextPlan(why="an output grammar verifies the head's drafts only")
        if seeded:
            return TextPlan(why="a seeded sampling request verifies the head's drafts only")
        cap = sampling.max_draft_tokens
        n = self.config.draft_tokens if cap is None else min(cap, self.config.draft_tokens)
        if n == 0:
            return TextPlan(why="the request allows no drafts (max_draft_tokens 0)")
        self._draft_planned += 1
        return TextPlan(Speculate(self.config.mtp_block_size, head=False, context=n, draft=True, copy=False))

    def _head_pays(self) -> tuple[bool, str]:
        """Whether the head's drafts are planned (`mtp_policy`), and why not."""
        k = self.config.mtp_block_size
        if self.config.mtp_policy == "auto" and self.round_cost is not None:
            r = self.round_cost
            if k / r <= 1.0:
                return False, f"a round costs {r:.2f} plain steps here: {k} tokens per round cannot pay"
            head = self._drafts.mtp
            if head.drafted >= MIN_DRAFTS:
                a = head.accepted / head.drafted
                if (1 + a * (k - 1)) / r <= 1.0:
                    self._unpaid += 1
                    if self._unpaid % EXPLORE_EVERY:
                        return False, f"at acceptance {a:.2f} a round of {r:.2f} plain steps does not pay"
        return True, ""

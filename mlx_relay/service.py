"""ChatService: walks one chat request through the actors; shared by HTTP and the in-process API.

    Admission (slot lease)
    -> Normalizer (template + tokens; a request with media goes on to the MediaRouter from
       there: fetch, decode, preprocess, expand) -> Prompt
    -> PrefixCacheStore (what to restore, what to snapshot) -> PrefixPlan
    -> text:   SpecPrefillScorer (a long prompt: score it on the GPU? how much to keep)
               TextMTPExecutor (MTP or plain, block size)
       vision: VisionExecutor (which image features are reused, pinned)
    -> GPUExecutor (Generate carrying every plan; stream of TokenDelta ..., Finished)
    -> PrefixCacheStore / VisionExecutor (release)

Each hop either answers a decision or does the work; nothing comes back only to be sent on.
`prepare` (the front half: render, route, context check) is shared with `count_tokens`.
Text-only requests never wait behind a media download: only the vision path asks the MediaRouter.

Everything is scoped: leaving `generate`'s `async with` (done, error, client gone) cancels the
generation and frees the admission slot through the runtime's structured cancellation.

With `metrics` (the server's `RequestMetrics`), each request is observed on its way: the queue
wait when its slot is granted, the prefix-cache lookup, and the engine's events as they pass to
the caller (first token, later tokens, the end, or an abort when the stream is left unfinished).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import anyio
import msgspec

from mlx_relay.chat.grammar import OutputConstraint
from mlx_relay.chat.output import ContentDelta, InvalidReason, ReplyDone, ReplyEvent, ReplyStarted
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import ChatMessage, ResponseFormat, ToolChoice, ToolDef
from mlx_relay.config import MAX_DRAFT_TOKENS
from mlx_relay.embeddings import EmbeddingService
from mlx_relay.errors import DraftModelUnavailable, InvalidRequest, MaxTokensExceedContext, PromptTooLong
from mlx_relay.messages.admission import Acquire, Granted
from mlx_relay.messages.gpu import Finished, Generate, ModelInfo, SamplingParams, SpeculationMethod, TokenDelta
from mlx_relay.messages.prefix_cache import Lookup, PrefixPlan, Release
from mlx_relay.messages.prompt import Prompt, Render
from mlx_relay.messages.specprefill import PlanSpecPrefill, SpecPrefillDecision, SpecPrefillReport
from mlx_relay.messages.text_mtp import PlanText, TextPlan
from mlx_relay.messages.vision import PlanVision, ReleaseVision
from mlx_relay.metrics.requests import RequestClock, RequestMetrics
from mlx_relay.runtime import ActorRef, ReplyStream

log = logging.getLogger(__name__)

EngineEvents = AsyncIterator[TokenDelta | Finished]  # one generation's stream: TokenDelta ..., Finished


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A front-end-neutral chat request (the wire formats convert into this)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    template_kwargs: dict[str, Any] = {}
    mtp: bool = True  # MTP speculative decoding where the text path has it
    # where speculative drafts may come from (`SpeculationMethod`: "auto", "mtp", "context",
    # "draft", "none"; None: the server's `--speculation`) and at most how many context drafts
    # per round (0..MAX_DRAFT_TOKENS; None: the server's, which also caps it)
    speculation: str | None = None
    max_draft_tokens: int | None = None
    # thinking: None leaves the chat template's default; a budget caps the thinking tokens
    # (the engine then closes the thinking block itself)
    enable_thinking: bool | None = None
    thinking_budget: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20 alternatives per token (with logprobs)
    presence_penalty: float = 0.0  # OpenAI's: over the tokens generated so far
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # multiplicative (> 1 discourages repeats)
    # /v1/completions: a raw prompt (text or token ids) instead of messages; no chat template
    prompt: str | list[int] | None = None
    # SpecPrefill: None follows the server (on above its threshold when it has a draft model);
    # True / False forces it on / off for this request; the keep fraction and the anchor rule's
    # n-gram length (0: no anchors) override the server's
    specprefill: bool | None = None
    specprefill_keep: float | None = None
    specprefill_anchor_ngram: int | None = None
    chat_template: str | None = None  # the request's own template (refused unless the server allows it)


class SamplingDefaults(msgspec.Struct, frozen=True):
    """From the checkpoint's generation_config.json; a request's own values win."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0

    @classmethod
    def from_generation_config(cls, config: dict[str, Any]) -> SamplingDefaults:
        if config.get("do_sample") is False:
            return cls(temperature=0.0)
        return cls(
            temperature=float(config.get("temperature", 1.0)),
            top_p=float(config.get("top_p", 1.0)),
            top_k=int(config.get("top_k", 0) or 0),
            min_p=float(config.get("min_p", 0.0) or 0.0),
        )


@dataclass
class ReplyTally:
    """What one reply has cost so far, kept up to date as it streams, so that whoever accounts for
    the request (the HTTP request log) knows it however the reply ends: finished, failed, or cut
    by a disconnect or the drain. `ReplyDone`'s exact figures replace the running count."""

    prompt_tokens: int | None = None  # known once the generation starts
    cached_tokens: int | None = None
    completion_tokens: int = 0
    first_token_at: float | None = None  # time.monotonic() when the first token came
    finish_reason: str | None = None  # None: the reply did not finish
    pieces: list[str] = field(default_factory=list)  # the reply's text, only when asked for (`keep_text`)
    keep_text: bool = False
    token_ids: list[int] = field(default_factory=list)  # the generated ids, only when asked for (`keep_tokens`)
    keep_tokens: bool = False


@dataclass(frozen=True)
class Actors:
    """The actors a request walks through (None: that feature is off)."""

    admission: ActorRef
    normalizer: ActorRef
    gpu: ActorRef
    text: ActorRef
    vision: ActorRef | None = None
    prefix_store: ActorRef | None = None
    scorer: ActorRef | None = None


@dataclass(frozen=True)
class Admitted:
    """Slots held for a request's replies (`ChatService.admit`); `arrived`: `time.perf_counter()`
    when the request asked for them."""

    arrived: float


class ChatService:
    def __init__(self, actors: Actors, info: ModelInfo, defaults: SamplingDefaults, *, default_max_tokens: int,
                 max_tokens_policy: Literal["error", "clamp"] = "clamp",
                 tool_grammar: Literal["lazy", "off"] = "lazy",
                 metrics: RequestMetrics | None = None) -> None:
        self.actors = actors
        self.gpu = actors.gpu
        self.prefix_store = actors.prefix_store
        self.scorer = actors.scorer
        self.info = info
        self.defaults = defaults
        self.default_max_tokens = default_max_tokens
        self.max_tokens_policy = max_tokens_policy
        self.tool_grammar = tool_grammar
        self.metrics = metrics
        self._ids = itertools.count(1)
        # the embedding model beside the chat model (`/v1/embeddings`), where the engine holds one
        self.embeddings = EmbeddingService(actors.gpu, info.embedding) if info.embedding is not None else None

    def sampling_for(self, req: ChatRequest, prompt_tokens: int, prompt: Prompt | None = None) -> SamplingParams:
        context = self.info.context_length
        room = context - prompt_tokens
        if room <= 0:
            raise PromptTooLong(
                f"this model's maximum context length is {context} tokens; the prompt has {prompt_tokens} tokens",
                prompt_tokens=prompt_tokens, limit=context - 1)
        memory = self.info.memory_tokens  # what one request's caches can hold on this device (0: not counted)
        if 0 < memory < context:
            if prompt_tokens >= memory:
                raise PromptTooLong(
                    f"this server's device memory holds the caches of at most {memory} tokens for one request "
                    f"(within its memory limit of {self.info.memory_limit_bytes / 2**30:.1f} GiB, beside the "
                    f"model's weights and the prefix cache); the prompt has {prompt_tokens} tokens",
                    prompt_tokens=prompt_tokens, limit=memory - 1)
            context, room = memory, memory - prompt_tokens
        validate_request(req, draft_model=self.info.speculative_draft is not None)
        if req.max_tokens is not None and req.max_tokens > room and self.max_tokens_policy == "error":
            raise MaxTokensExceedContext(
                f"max_tokens is {req.max_tokens}, but this model's maximum context length is {context} tokens "
                f"and the prompt has {prompt_tokens}: at most {room} can be generated",
                prompt_tokens=prompt_tokens, max_tokens=req.max_tokens, context_length=context)
        think_open = prompt.think_open if prompt is not None else False
        grammar = prompt.grammar if prompt is not None else None
        # the reply may run to the context's end, never past it; a request without max_tokens
        # gets the server's default (cut at the context's end)
        max_tokens = min(req.max_tokens or self.default_max_tokens, room)
        budget = req.thinking_budget
        if grammar is not None and think_open and forced_tools(req):
            # a forced call must fit after the thinking: leave it half the tokens (at most 1024)
            left_for_call = max(1, min(max_tokens // 2, 1024))
            budget = min(budget if budget is not None else max_tokens, max(0, max_tokens - left_for_call))
        d = self.defaults
        params = SamplingParams(
            temperature=d.temperature if req.temperature is None else req.temperature,
            top_p=d.top_p if req.top_p is None else req.top_p,
            top_k=d.top_k if req.top_k is None else req.top_k,
            min_p=d.min_p if req.min_p is None else req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop,
            mtp=req.mtp,
            speculation=req.speculation,  # type: ignore[arg-type]  # checked by validate_request
            max_draft_tokens=req.max_draft_tokens,
            logprobs=req.top_logprobs if req.logprobs else -1,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            grammar=grammar,
            grammar_after_thinking=think_open,
            think_open=think_open,
            thinking_budget=budget,
        )
        validate_sampling(params)
        return params

    @asynccontextmanager
    async def generate(self, req: ChatRequest, request_id: str | None = None) -> AsyncIterator[EngineEvents]:
        """Admit, render and start generating; yields the engine's stream of TokenDelta ... Finished."""
        async with self._start(req, request_id) as (_, _started, events):
            yield events

    @asynccontextmanager
    async def admit(self, request_id: str, slots: int = 1) -> AsyncIterator[Admitted]:
        """Hold `slots` admission slots (granted together) for replies started with `admitted=`."""
        arrived = time.perf_counter()
        async with self.actors.admission.stream(Acquire(request_id, slots)) as lease:
            granted = await anext(lease)
            assert isinstance(granted, Granted)
            if self.metrics is not None:
                self.metrics.queued(granted.waited_s)
            yield Admitted(arrived)

    @asynccontextmanager
    async def reply(self, req: ChatRequest, request_id: str | None = None, *, admitted: Admitted | None = None,
                    raw: bool = False, tally: ReplyTally | None = None) -> AsyncIterator[AsyncIterator[ReplyEvent]]:
        """As `generate`, parsed: reasoning, content and tool calls, then `ReplyDone`
        (`mlx_relay.chat.output`). What the model writes wrong in a tool call reaches the caller as
        written (`chat.reply_parser`) and is counted in the metrics, never raised.
        `admitted`: the caller holds a slot (`admit`).
        `raw` (text completions): every piece of text is content, exactly as generated.
        `tally`: kept up to date with the reply's tokens as they come."""
        async with self._start(req, request_id, admitted) as (prompt, started, events):
            tools = req.tools if req.tool_choice != "none" else None
            parser = None if raw else ReplyParser(tools=tools, tool_format=prompt.tool_format,
                                                  think_open=prompt.think_open, on_invalid=self._invalid_call)
            yield _parsed(started, events, parser, tally or ReplyTally())

    def _invalid_call(self, reason: InvalidReason, what: str) -> None:
        """What the model wrote wrong in a tool call (delivered as written): logged and counted."""
        log.info("tool call delivered as the model wrote it (%s): %s", reason, what)
        if self.metrics is not None:
            self.metrics.tool_call_invalid(reason, what)

    async def count_tokens(self, req: ChatRequest) -> int:
        """The prompt's length in tokens as `generate` would see it (media expanded); no slot,
        no GPU. Prompts beyond four times the context are refused rather than counted."""
        return len((await self.prepare(req, 4 * self.info.context_length)).token_ids)

    async def prepare(self, req: ChatRequest, max_prompt_tokens: int) -> Prompt:
        """The front half of every request: rendered, tokenized, media routed and expanded."""
        prompt: Prompt = await self.actors.normalizer.request(self._render_msg(req, max_prompt_tokens))
        return prompt

    def _render_msg(self, req: ChatRequest, max_prompt_tokens: int) -> Render:
        constraint = None
        # forced calls, structured output, or tools the model may call (`auto`: a lazy grammar,
        # unless the server leaves auto calls free: `--tool-grammar off`)
        if forced_tools(req) or (req.response_format and req.response_format.type != "text") or \
                (req.tools and req.tool_choice == "auto" and self.tool_grammar == "lazy"):
            constraint = OutputConstraint(response_format=req.response_format, tools=req.tools,
                                          tool_choice=req.tool_choice, parallel_tool_calls=req.parallel_tool_calls)
        if req.prompt is not None:
            return Render([], raw_prompt=req.prompt, constraint=constraint, max_prompt_tokens=max_prompt_tokens)
        kwargs = dict(req.template_kwargs)
        template = req.chat_template
        if "chat_template" in kwargs:  # where vLLM's clients put it
            given = kwargs.pop("chat_template")
            if not isinstance(given, str):
                raise InvalidRequest("chat_template must be a string", param="chat_template_kwargs")
            template = template or given
        if req.enable_thinking is not None:
            kwargs["enable_thinking"] = req.enable_thinking
        tools = req.tools if req.tool_choice != "none" else None
        return Render(req.messages, tools, kwargs, constraint=constraint, max_prompt_tokens=max_prompt_tokens,
                      chat_template=template)

    @asynccontextmanager
    async def _start(self, req: ChatRequest, request_id: str | None, admitted: Admitted | None = None
                     ) -> AsyncIterator[tuple[Prompt, ReplyStarted, EngineEvents]]:
        rid = request_id or f"req-{next(self._ids)}"
        async with AsyncExitStack() as stack:
            if admitted is None:
                admitted = await stack.enter_async_context(self.admit(rid))
            # the prompt must leave room for at least one generated token
            prompt = await self.prepare(req, self.info.context_length - 1)
            params = self.sampling_for(req, len(prompt.token_ids), prompt)
            plan = await self._plan_prefix(rid, req, prompt, stack)
            gen = await self._plan_decode(rid, req, prompt, params, plan, stack)
            started = ReplyStarted(len(prompt.token_ids), plan.restore_length if plan is not None else 0)
            metrics = self.metrics
            async with self.gpu.stream(gen) as events:
                if metrics is None:
                    yield prompt, started, events
                    return
                if plan is not None:
                    metrics.prefix_lookup(started.prompt_tokens, started.cached_tokens)
                if prompt.loose_tools:
                    metrics.loose_tools.inc(len(prompt.loose_tools))
                clock = metrics.clock(admitted.arrived, started.prompt_tokens)
                try:
                    yield prompt, started, _Observed(events, clock)
                finally:
                    clock.close()

    async def _plan_prefix(self, rid: str, req: ChatRequest, prompt: Prompt, stack: AsyncExitStack
                           ) -> PrefixPlan | None:
        store = self.prefix_store
        if store is None or self.info.prefix_cache_bytes <= 0 or prompt.media is None:
            return None  # off, or media that cannot be keyed
        stack.push_async_callback(_tell_shielded, store, Release(rid))
        # a request: a plan restored from disk is answered once the file is loaded, off the store's mailbox
        return await store.request(Lookup(rid, prompt.token_ids, prompt.media, prompt.boundaries,
                                          multi_turn=prompt.multi_turn, has_tools=bool(req.tools)))

    async def _plan_decode(self, rid: str, req: ChatRequest, prompt: Prompt, params: SamplingParams,
                           plan: PrefixPlan | None, stack: AsyncExitStack) -> Generate:
        """The vision path asks the VisionExecutor (features reused, pinned); the text path the
        SpecPrefillScorer (sparse prefill?) and the TextMTPExecutor (MTP?)."""
        tokens = prompt.token_ids
        if prompt.vision is not None:
            if self.actors.vision is not None:
                stack.push_async_callback(_tell_shielded, self.actors.vision, ReleaseVision(rid))
                await self.actors.vision.ask(PlanVision(rid, list(prompt.vision.content_hashes)))
            report = None
            if req.specprefill is True:
                report = SpecPrefillReport(False, fallback="requests with images or video are prefilled in full")
            return Generate(rid, tokens, params, prompt.vision, plan, specprefill=report)
        decision = await self._specprefill(rid, req, len(tokens), plan)
        text: TextPlan = await self.actors.text.ask(PlanText(rid, params, sparse=decision.score is not None
                                                             or decision.sparse is not None))
        return Generate(rid, tokens, params, None, plan, text.speculate, decision.score,
                        decision.sparse, decision.report)

    async def _specprefill(self, rid: str, req: ChatRequest, n: int, plan: PrefixPlan | None) -> SpecPrefillDecision:
        """SpecPrefill's decision for a text prompt. If the scorer cannot be reached the request
        still goes on, prefilled normally."""
        if req.specprefill is False:
            return SpecPrefillDecision()
        if self.scorer is None:
            why = "this server has no SpecPrefill draft model (--specprefill-draft-model)"
            return SpecPrefillDecision(report=SpecPrefillReport(False, fallback=why) if req.specprefill else None)
        # the restored prefix (and the snapshot points the scorer keeps) are never scored
        restored, points = (plan.restore_length, plan.snapshot_at) if plan is not None else (0, [])
        try:
            decision: SpecPrefillDecision = await self.scorer.ask(
                PlanSpecPrefill(rid, n, restored, points, req.specprefill, req.specprefill_keep,
                                req.specprefill_anchor_ngram))
            return decision
        except Exception as exc:  # the scorer crashed: this request prefills normally
            return SpecPrefillDecision(report=SpecPrefillReport(
                False, fallback=f"the scorer failed ({type(exc).__name__})"))


class _Observed:
    """The engine's events, each shown to the request's clock on its way to the caller."""

    __slots__ = ("_clock", "_events")

    def __init__(self, events: ReplyStream, clock: RequestClock) -> None:
        self._events = events
        self._clock = clock

    def __aiter__(self) -> _Observed:
        return self

    async def __anext__(self) -> TokenDelta | Finished:
        event: TokenDelta | Finished = await self._events.__anext__()
        self._clock.saw(event)
        return event


async def _tell_shielded(ref: ActorRef, msg: msgspec.Struct) -> None:
    """A release that must reach its actor however the request ends (cancelled included)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
        await ref.tell(msg)


def forced_tools(req: ChatRequest) -> bool:
    """The reply must be tool calls (`required` or a named function; without tools a 400)."""
    return req.tool_choice not in ("auto", "none")


SPECULATION_METHODS: tuple[str, ...] = get_args(SpeculationMethod)
_SEED_LIMIT = 2**63  # seeds are 63-bit (numpy's and MLX's generators take them)
MAX_ANCHOR_NGRAM = 64  # a request's SpecPrefill anchor n-gram (longer runs are whole sentences)


def validate_request(req: ChatRequest, *, draft_model: bool = False) -> None:
    """The request's own numbers, each a 400 naming its parameter (OpenAI's ranges); `draft_model`:
    the server has one (else `speculation.method: "draft"` is refused)."""
    checks: list[tuple[bool, str, str]] = [
        (req.max_tokens is None or req.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
        (req.seed is None or 0 <= req.seed < _SEED_LIMIT, "seed", "seed must be in [0, 2^63)"),
        (-2.0 <= req.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be between -2 and 2"),
        (-2.0 <= req.frequency_penalty <= 2.0, "frequency_penalty", "frequency_penalty must be between -2 and 2"),
        (req.repetition_penalty is None or 0.0 < req.repetition_penalty <= 1000.0, "repetition_penalty",
         "repetition_penalty must be in (0, 1000]"),
        (req.thinking_budget is None or req.thinking_budget >= 0, "thinking_budget",
         "the thinking budget must not be negative"),
        (req.specprefill_keep is None or 0.0 < req.specprefill_keep <= 1.0, "specprefill_keep",
         "specprefill_keep must be in (0, 1]"),
        (req.specprefill_anchor_ngram is None or 0 <= req.specprefill_anchor_ngram <= MAX_ANCHOR_NGRAM,
         "specprefill_anchor_ngram", f"specprefill_anchor_ngram must be between 0 (off) and {MAX_ANCHOR_NGRAM}"),
        (not req.logprobs or 0 <= req.top_logprobs <= 20, "top_logprobs", "top_logprobs must be between 0 and 20"),
        (req.speculation is None or req.speculation in SPECULATION_METHODS, "speculation.method",
         f"speculation.method must be one of {', '.join(SPECULATION_METHODS)}"),
        (req.max_draft_tokens is None or 0 <= req.max_draft_tokens <= MAX_DRAFT_TOKENS, "speculation.max_draft_tokens",
         f"speculation.max_draft_tokens must be an integer from 0 to {MAX_DRAFT_TOKENS}"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequest(message, param=param)
    if req.speculation == "draft" and not draft_model:
        raise DraftModelUnavailable('speculation.method "draft" needs a draft model, and this server has none loaded '
                                    "(start it with --draft-model)", param="speculation.method")


def validate_sampling(p: SamplingParams) -> None:
    checks: list[tuple[bool, str, str]] = [
        (0.0 <= p.temperature <= 100.0, "temperature", "temperature must be between 0 and 100"),
        (0.0 < p.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
        (p.top_k >= 0, "top_k", "top_k must be >= 0"),
        (0.0 <= p.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
        (len(p.stop) <= 16, "stop", "at most 16 stop sequences"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequest(message, param=param)


async def _parsed(started: ReplyStarted, events: EngineEvents, parser: ReplyParser | None, tally: ReplyTally
                  ) -> AsyncIterator[ReplyEvent]:
    tally.prompt_tokens, tally.cached_tokens = started.prompt_tokens, started.cached_tokens
    yield started
    reasoning = 0
    async for ev in events:
        if isinstance(ev, TokenDelta):
            if ev.token_ids:
                tally.completion_tokens += len(ev.token_ids)
                if tally.first_token_at is None:
                    tally.first_token_at = time.monotonic()
            if tally.keep_text:
                tally.pieces.append(ev.text)
            if tally.keep_tokens:
                tally.token_ids.extend(ev.token_ids)
            if parser is None:
                if ev.text or ev.logprobs:
                    yield ContentDelta(ev.text, ev.logprobs)
                continue
            if parser.thinking:  # the tokens up to and including `</think>` are reasoning
                reasoning += len(ev.token_ids)
            for out in parser.feed(ev.text, ev.logprobs):
                yield out
        elif isinstance(ev, Finished):
            for out in parser.finish(ev.reason) if parser is not None else ():
                yield out
            # a reply cut by max_tokens ends "length", whatever calls came before the cut
            reason = "tool_calls" if parser is not None and parser.calls and ev.reason != "length" else ev.reason
            tally.prompt_tokens, tally.cached_tokens = ev.prompt_tokens, ev.cached_tokens
            tally.completion_tokens, tally.finish_reason = ev.completion_tokens, reason
            yield ReplyDone(reason, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, reasoning,
                            drafts=ev.drafts,
                            stop_sequence=ev.stop_sequence, specprefill=ev.specprefill)
            return

"""ChatService: walks one chat request through the actors; shared by HTTP and the in-process API.

    Admission (slot lease) -> Normalizer (template + tokens, system-prompt boundary)
        -> MediaRouter (only for requests with images or video: fetch, decode, preprocess, expand)
        -> context check -> PrefixCacheStore (what to restore, what to snapshot)
        -> SpecPrefillScorer (long text prompts: which uncached tokens the target prefills)
        -> GPUExecutor (stream of TokenDelta ..., Finished) -> PrefixCacheStore (release)

Text-only requests never wait behind a media download: the routing decision (media parts or
none) is already known after normalization, and only the vision path asks the MediaRouter.

Everything is scoped: leaving `generate`'s `async with` (done, error, client gone) cancels the
generation and frees the admission slot through the runtime's structured cancellation.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal

import anyio
import msgspec

from mlx_relay.actors.admission import Acquire, Granted
from mlx_relay.actors.media_router import Route, Routed
from mlx_relay.actors.normalizer import Render, RenderedPrompt
from mlx_relay.actors.prefix_cache_store import Lookup, Release
from mlx_relay.actors.specprefill_scorer import Select, Selection
from mlx_relay.cache.prefix_keys import MediaSpan
from mlx_relay.chat.grammar import OutputConstraint
from mlx_relay.chat.output import ContentDelta, ReplyDone, ReplyEvent, ReplyStarted
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import ChatMessage, ResponseFormat, ToolChoice, ToolDef
from mlx_relay.engine.messages import (
    Finished,
    Generate,
    ModelInfo,
    PrefixPlan,
    SamplingParams,
    SpecPrefillReport,
    TokenDelta,
)
from mlx_relay.errors import ContextLengthExceeded, InvalidRequest
from mlx_relay.media.tensors import VisionInputs
from mlx_relay.runtime import ActorRef, ReplyStream


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
    # True / False forces it on / off for this request; the keep fraction overrides the server's
    specprefill: bool | None = None
    specprefill_keep: float | None = None
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


class ChatService:
    def __init__(
        self,
        *,
        admission: ActorRef,
        normalizer: ActorRef,
        media: ActorRef,
        gpu: ActorRef,
        info: ModelInfo,
        defaults: SamplingDefaults,
        default_max_tokens: int,
        max_tokens_policy: Literal["error", "clamp"] = "error",
        prefix_store: ActorRef | None = None,
        scorer: ActorRef | None = None,
    ) -> None:
        self.admission = admission
        self.normalizer = normalizer
        self.media = media
        self.gpu = gpu
        self.info = info
        self.defaults = defaults
        self.default_max_tokens = default_max_tokens
        self.max_tokens_policy = max_tokens_policy
        self.prefix_store = prefix_store
        self.scorer = scorer
        self._ids = itertools.count(1)

    def sampling_for(self, req: ChatRequest, prompt_tokens: int, rendered: RenderedPrompt | None = None
                     ) -> SamplingParams:
        room = self.info.context_length - prompt_tokens
        if room <= 0:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.info.context_length} tokens; "
                f"the prompt has {prompt_tokens} tokens",
                param="messages",
            )
        validate_request(req)
        if req.max_tokens is not None and req.max_tokens > room and self.max_tokens_policy == "error":
            raise ContextLengthExceeded(
                f"max_tokens is {req.max_tokens}, but this model's maximum context length is "
                f"{self.info.context_length} tokens and the prompt has {prompt_tokens}: at most {room} can be "
                "generated", param="max_tokens")
        think_open = rendered.think_open if rendered is not None else False
        grammar = rendered.grammar if rendered is not None else None
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
    async def generate(self, req: ChatRequest, request_id: str | None = None) -> AsyncIterator[ReplyStream]:
        """Admit, render and start generating; yields the engine's stream of TokenDelta ... Finished."""
        async with self._start(req, request_id) as (_, _started, events):
            yield events

    @asynccontextmanager
    async def admit(self, request_id: str, slots: int = 1) -> AsyncIterator[None]:
        """Hold `slots` admission slots (granted together) for replies started with `admitted=True`."""
        async with self.admission.stream(Acquire(request_id, slots)) as lease:
            granted = await anext(lease)
            assert isinstance(granted, Granted)
            yield

    @asynccontextmanager
    async def reply(self, req: ChatRequest, request_id: str | None = None, *, admitted: bool = False,
                    raw: bool = False) -> AsyncIterator[AsyncIterator[ReplyEvent]]:
        """As `generate`, parsed: reasoning, content and tool calls, then `ReplyDone`
        (`mlx_relay.chat.output`). A tool call that does not fit its schema raises
        `ToolCallInvalid` from the stream. `admitted`: the caller holds a slot (`admit`).
        `raw` (text completions): every piece of text is content, exactly as generated."""
        async with self._start(req, request_id, admitted) as (rendered, started, events):
            tools = req.tools if req.tool_choice != "none" else None
            parser = None if raw else ReplyParser(tools=tools, tool_format=rendered.tool_format,
                                                  think_open=rendered.think_open)
            yield _parsed(started, events, parser)

    async def count_tokens(self, req: ChatRequest) -> int:
        """The prompt's length in tokens as `generate` would see it (media expanded); no slot,
        no GPU. Prompts beyond four times the context are refused rather than counted."""
        rendered: RenderedPrompt = await self.normalizer.request(self._render_msg(req, 4 * self.info.context_length))
        if rendered.num_media:
            self._check_vision()
            routed: Routed = await self.media.ask(Route(rendered.messages, rendered.token_ids))
            return len(routed.prompt_tokens)
        return len(rendered.token_ids)

    def _check_vision(self) -> None:
        if not self.info.has_vision:
            raise InvalidRequest("this model has no vision tower: send text only", param="messages")

    def _render_msg(self, req: ChatRequest, max_prompt_tokens: int) -> Render:
        constraint = None
        if forced_tools(req) or (req.response_format and req.response_format.type != "text"):
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
    async def _start(self, req: ChatRequest, request_id: str | None, admitted: bool = False
                     ) -> AsyncIterator[tuple[RenderedPrompt, ReplyStarted, ReplyStream]]:
        rid = request_id or f"req-{next(self._ids)}"
        async with AsyncExitStack() as stack:
            if not admitted:
                await stack.enter_async_context(self.admit(rid))
            # the prompt must leave room for at least one generated token
            rendered: RenderedPrompt = await self.normalizer.request(
                self._render_msg(req, self.info.context_length - 1))
            tokens, vision = rendered.token_ids, None
            if rendered.num_media:
                self._check_vision()
                routed: Routed = await self.media.ask(Route(rendered.messages, rendered.token_ids))
                tokens, vision = routed.prompt_tokens, routed.vision
            params = self.sampling_for(req, len(tokens), rendered)
            plan = await self._plan(rid, req, tokens, vision, rendered)
            selection = await self._sparse(rid, req, tokens, vision, plan)
            gen = Generate(rid, tokens, params, vision, plan, selection.sparse, selection.report)
            started = ReplyStarted(len(tokens), plan.restore_length if plan is not None else 0)
            try:
                async with self.gpu.stream(gen) as events:
                    yield rendered, started, events
            finally:
                if plan is not None and self.prefix_store is not None:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                        await self.prefix_store.tell(Release(rid))

    async def _plan(self, rid: str, req: ChatRequest, tokens: list[int], vision: VisionInputs | None,
                    rendered: RenderedPrompt) -> PrefixPlan | None:
        if self.prefix_store is None:
            return None
        media: list[MediaSpan] = []
        if vision is not None:
            if len(vision.spans) != len(vision.content_hashes):  # cannot key its media: no reuse
                return None
            media = [MediaSpan(a, b, h) for (a, b), h in zip(vision.spans, vision.content_hashes, strict=True)]
        # the system prompt's end in the rendered tokens holds in the routed ones if no media
        # placeholder was expanded before it
        s = rendered.system_end
        if media and s > media[0].start:
            s = 0
        # the reply's start follows every message, so every expanded media item precedes it
        r = rendered.reply_start + len(tokens) - len(rendered.token_ids) if rendered.reply_start else 0
        # what says a next turn is likely (the store decides whether to snapshot the turn)
        multi_turn = any(m.role in ("assistant", "tool") for m in rendered.messages)
        return await self.prefix_store.ask(Lookup(rid, tokens, media, s, r, multi_turn=multi_turn,
                                                  has_tools=bool(req.tools)))


    async def _sparse(self, rid: str, req: ChatRequest, tokens: list[int], vision: VisionInputs | None,
                      plan: PrefixPlan | None) -> Selection:
        """SpecPrefill's selection for a text prompt (None: prefill every token). The scorer's
        own failures come back as a fallback report; if the scorer cannot be reached at all the
        request still goes on, prefilled normally."""
        if req.specprefill is False:
            return Selection(None, None)
        asked = req.specprefill is True
        if self.scorer is None or vision is not None:
            why = ("this server has no SpecPrefill draft model (--specprefill-draft-model)" if self.scorer is None
                   else "requests with images or video are prefilled in full")
            return Selection(None, SpecPrefillReport(False, fallback=why) if asked else None)
        # the restored prefix (and the snapshot points the scorer keeps) are never scored
        restored, points = (plan.restore_length, plan.snapshot_at) if plan is not None else (0, [])
        select = Select(rid, tokens, restored, points, req.specprefill, req.specprefill_keep)
        try:
            async with self.scorer.stream(select) as s:
                return await anext(s)
        except Exception as exc:  # the scorer crashed: this request prefills normally
            return Selection(None, SpecPrefillReport(False, fallback=f"the scorer failed ({type(exc).__name__})"))


def forced_tools(req: ChatRequest) -> bool:
    """The reply must be tool calls (`required` or a named function; without tools a 400)."""
    return req.tool_choice not in ("auto", "none")


_SEED_LIMIT = 2**63  # seeds are 63-bit (numpy's and MLX's generators take them)


def validate_request(req: ChatRequest) -> None:
    """The request's own numbers, each a 400 naming its parameter (OpenAI's ranges)."""
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
        (not req.logprobs or 0 <= req.top_logprobs <= 20, "top_logprobs", "top_logprobs must be between 0 and 20"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequest(message, param=param)


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


async def _parsed(started: ReplyStarted, events: ReplyStream, parser: ReplyParser | None
                  ) -> AsyncIterator[ReplyEvent]:
    yield started
    reasoning = 0
    async for ev in events:
        if isinstance(ev, TokenDelta):
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
            yield ReplyDone(reason, ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens, reasoning,
                            mtp_drafted=ev.mtp_drafted, mtp_accepted=ev.mtp_accepted, specprefill=ev.specprefill)
            return

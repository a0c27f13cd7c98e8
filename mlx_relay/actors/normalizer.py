"""Normalizer: turns a chat request into prompt tokens, several at once, none delaying another.

    ChatService --Render (one-reply stream)--> Normalizer --> Prompt
        (a request with images or video: Normalizer --Route--> MediaRouter on the way)
    Relay --DescribePrompts (ask)--> Normalizer --> PromptFeatures (tools, reasoning: /v1/models)

It owns the tokenizer and chat template (loaded from the checkpoint, no MLX) through a
`chat.prompt_render.PromptRenderer`. Cheap checks run in the handler (reserved template kwargs, a
client template the server does not allow, a prompt whose character count already exceeds the
context); the render itself (normalize, template, tokenize, grammar) is a job in a worker thread,
so the mailbox keeps moving. Two lanes (`PromptConfig`): prompts up to `large_prompt_bytes` in
one pool, larger ones in another of a few workers, so a 10 MB prompt never queues a small one;
each render has a deadline (`render_timeout_s`, a 400 past it). A client that leaves cancels its
render's wait. Client-supplied templates render in `TemplateSandbox`'s process. A prompt with
media parts goes on to the MediaRouter (its reference given at construction) from the same job,
so the requester gets the final prompt, expanded, in one reply; the normalized messages never
travel back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from mlx_relay.chat.prompt_render import PromptRenderer, prompt_chars, template_renders_tools
from mlx_relay.chat.reply_parser import reasoning_in_template, tool_format_for_template
from mlx_relay.chat.template_sandbox import TemplateSandbox
from mlx_relay.config import PromptConfig
from mlx_relay.errors import InvalidRequest
from mlx_relay.messages.prompt import (
    DescribePrompts,
    Prompt,
    PromptFeatures,
    Render,
    RenderedPrompt,
    Route,
    Routed,
)
from mlx_relay.runtime import Actor, ActorRef, ReplyStream

__all__ = ["Normalizer", "PromptTooSlow"]


class PromptTooSlow(InvalidRequest):
    """The prompt could not be prepared (template + tokenization) within the render deadline."""

    code = "prompt_too_large"


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


class Normalizer(Actor):
    accepts = (Render, DescribePrompts)
    mailbox_capacity = 1024

    def __init__(self, model_path: Path, config: PromptConfig, media: ActorRef) -> None:
        self.model_path = model_path
        self.config = config
        self.media = media
        self.renderer: PromptRenderer | None = None
        self.features = PromptFeatures(None, False)
        self._small = anyio.CapacityLimiter(config.small_workers)
        self._large = anyio.CapacityLimiter(config.large_workers)

    async def on_start(self) -> None:
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, self.model_path)
        template = getattr(tokenizer, "chat_template", None)
        own = template if isinstance(template, str) else None
        # a template that renders no tools (Gemma 3's) gets them written in, as "json" calls (chat/tool_prompt.py)
        fold = own is not None and not await anyio.to_thread.run_sync(template_renders_tools, tokenizer)
        tool_format = self.config.tool_parser or tool_format_for_template(own) or ("json" if fold else None)
        sandbox = None
        if self.config.allow_request_chat_template:
            sandbox = TemplateSandbox(dict(tokenizer.special_tokens_map), self.config.template_timeout_s,
                                      self.config.template_memory_bytes)
        self.renderer = PromptRenderer(tokenizer, tool_format, sandbox, fold_tools=fold)
        self.features = PromptFeatures(tool_format, reasoning_in_template(own))

    async def on_stop(self) -> None:
        if self.renderer is not None and self.renderer.sandbox is not None:
            await anyio.to_thread.run_sync(self.renderer.sandbox.close)

    async def receive(self, msg: Render | DescribePrompts, stream: ReplyStream | None) -> PromptFeatures | None:
        if isinstance(msg, DescribePrompts):
            return self.features
        assert self.renderer is not None and stream is not None
        self.renderer.check(msg)
        large = prompt_chars(msg.messages, msg.raw_prompt if isinstance(msg.raw_prompt, str) else None) \
            > self.config.large_prompt_bytes
        self.start_job(stream, lambda: self._prepare(msg, self._large if large else self._small))
        return None

    async def _prepare(self, msg: Render, lane: anyio.CapacityLimiter) -> Prompt:
        rendered = await self._render(msg, lane)
        routed = Routed("text", rendered.token_ids, None, rendered.boundaries)
        if rendered.num_media:
            routed = await self.media.ask(Route(rendered.messages, rendered.token_ids, rendered.boundaries))
        return Prompt(routed.prompt_tokens, routed.vision, routed.media, routed.boundaries,
                      multi_turn=any(m.role in ("assistant", "tool") for m in rendered.messages),
                      think_open=rendered.think_open, grammar=rendered.grammar, tool_format=rendered.tool_format,
                      loose_tools=rendered.loose_tools)

    async def _render(self, msg: Render, lane: anyio.CapacityLimiter) -> RenderedPrompt:
        assert self.renderer is not None
        renderer, timeout = self.renderer, self.config.render_timeout_s
        async with lane:
            with anyio.move_on_after(timeout):
                return await anyio.to_thread.run_sync(renderer.render, msg, abandon_on_cancel=True)
        raise PromptTooSlow(f"the prompt could not be prepared within {timeout:g}s", param="messages")

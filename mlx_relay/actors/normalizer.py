"""Normalizer: turns a chat request into prompt tokens.

It owns the tokenizer and chat template (loaded from the checkpoint, no MLX). It normalizes the
messages (developer -> system, systems hoisted and merged, same-role turns merged; see
`mlx_relay.chat.normalize`), renders the template and tokenizes, in a worker thread so a long
prompt does not stall the event loop. A conversation the template still rejects is a 400.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import jinja2
import msgspec

from mlx_relay.chat.normalize import (
    NormalizationError,
    media_parts,
    normalize_messages,
    to_template_messages,
)
from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.errors import InvalidRequest
from mlx_relay.runtime import Actor, ReplyStream


class Render(msgspec.Struct, frozen=True):
    """Ask: normalize, apply the chat template, tokenize. Reply: RenderedPrompt."""

    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    template_kwargs: dict[str, Any] = {}


class RenderedPrompt(msgspec.Struct, frozen=True):
    token_ids: list[int]
    num_media: int
    messages: list[ChatMessage]  # normalized: the MediaRouter reads the media parts from these


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


class Normalizer(Actor):
    accepts = (Render,)

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.tokenizer: Any = None

    async def on_start(self) -> None:
        self.tokenizer = await anyio.to_thread.run_sync(load_tokenizer, self.model_path)

    async def receive(self, msg: Render, stream: ReplyStream | None) -> RenderedPrompt:
        return await anyio.to_thread.run_sync(self._render, msg)

    def _render(self, msg: Render) -> RenderedPrompt:
        try:
            messages = normalize_messages(msg.messages)
            template_messages = to_template_messages(messages)
        except NormalizationError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        media = media_parts(messages)
        tools = [msgspec.to_builtins(t) for t in msg.tools] if msg.tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=False,
                **msg.template_kwargs,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected the conversation: {exc}", param="messages") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return RenderedPrompt(token_ids=list(ids), num_media=len(media), messages=messages)

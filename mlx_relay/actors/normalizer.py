"""Normalizer: turns a chat request into prompt tokens.

It owns the tokenizer and chat template (loaded from the checkpoint, no MLX). It normalizes the
messages (developer -> system, systems hoisted and merged, same-role turns merged; see
`mlx_relay.chat.normalize`), renders the template and tokenizes, in a worker thread so a long
prompt does not stall the event loop. A conversation the template still rejects is a 400.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import jinja2
import msgspec

from mlx_relay.chat.grammar import GrammarError, OutputConstraint, build_grammar, check_grammar
from mlx_relay.chat.normalize import (
    NormalizationError,
    media_parts,
    normalize_messages,
    to_template_messages,
)
from mlx_relay.chat.reply_parser import tool_format_for_template
from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.errors import InvalidRequest
from mlx_relay.runtime import Actor, ReplyStream


class Render(msgspec.Struct, frozen=True):
    """Ask: normalize, apply the chat template, tokenize. Reply: RenderedPrompt."""

    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    template_kwargs: dict[str, Any] = {}
    # /v1/completions: a raw prompt, tokenized as it is (no template, no normalization)
    raw_prompt: str | list[int] | None = None
    constraint: OutputConstraint | None = None  # response_format / required tool calls


class RenderedPrompt(msgspec.Struct, frozen=True):
    token_ids: list[int]
    num_media: int
    messages: list[ChatMessage]  # normalized: the MediaRouter reads the media parts from these
    # where the (normalized, hoisted, merged) system prompt ends in `token_ids`: the prefix every
    # turn of an agent's conversation shares (0: no system prompt before other messages)
    system_end: int = 0
    # how many leading tokens the next turn's prompt repeats (this prompt and its reply rendered
    # as history): the conversation's state there is what turn N+1 restores
    reply_start: int = 0
    # the prompt ends inside an open thinking block (the template opened `<think>`): the reply
    # starts with reasoning
    think_open: bool = False
    grammar: str | None = None  # llguidance grammar enforcing the request's constraint (validated)
    tool_format: str | None = None  # the model's tool-call syntax (`reply_parser.TOOL_FORMATS`)


def thinking_left_open(text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether `text` ends inside a thinking block (its last `<think>` is not closed)."""
    opened = text.rfind(start)
    return opened >= 0 and text.rfind(end) < opened


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


class Normalizer(Actor):
    accepts = (Render,)

    #: rendered system prompts whose tokens are kept (an agent resends the same one every turn)
    system_cache_entries = 64

    def __init__(self, model_path: Path, tool_parser: str | None = None) -> None:
        self.model_path = model_path
        self.tool_parser = tool_parser  # None: inferred from the chat template
        self.tokenizer: Any = None
        self.tool_format: str | None = None
        self._llg_tokenizer: Any = None
        self._system_ids: OrderedDict[str, list[int]] = OrderedDict()

    async def on_start(self) -> None:
        self.tokenizer = await anyio.to_thread.run_sync(load_tokenizer, self.model_path)
        template = getattr(self.tokenizer, "chat_template", None)
        self.tool_format = self.tool_parser or tool_format_for_template(template if isinstance(template, str) else None)

    async def receive(self, msg: Render, stream: ReplyStream | None) -> RenderedPrompt:
        return await anyio.to_thread.run_sync(self._render, msg)

    def _render(self, msg: Render) -> RenderedPrompt:
        rendered = self._raw(msg.raw_prompt) if msg.raw_prompt is not None else self._chat(msg)
        grammar = self._grammar(msg.constraint) if msg.constraint is not None else None
        return msgspec.structs.replace(rendered, grammar=grammar, tool_format=self.tool_format)

    def _grammar(self, constraint: OutputConstraint) -> str | None:
        c = msgspec.structs.replace(constraint, tool_format=self.tool_format)
        param = "response_format" if c.tool_choice in ("auto", "none") else "tool_choice"
        try:
            special = frozenset(self.tokenizer.get_added_vocab())
            grammar = build_grammar(c, special)
            if grammar is not None:
                check_grammar(grammar, self._llg())
        except GrammarError as exc:
            raise InvalidRequest(f"cannot enforce {param}: {exc}", param=param) from exc
        return grammar

    def _llg(self) -> Any:
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer)
        return self._llg_tokenizer

    def _chat(self, msg: Render) -> RenderedPrompt:
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
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        system_end = 0
        if len(template_messages) > 1 and template_messages[0].get("role") == "system":
            system_end = self._system_end(template_messages[0], tools, msg.template_kwargs, ids)
        reply_start = self._reply_start(template_messages, tools, msg.template_kwargs, text, enc["offset_mapping"])
        return RenderedPrompt(token_ids=ids, num_media=len(media), messages=messages, system_end=system_end,
                              reply_start=reply_start, think_open=thinking_left_open(text))

    def _raw(self, prompt: str | list[int]) -> RenderedPrompt:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=False))
            return RenderedPrompt(token_ids=ids, num_media=0, messages=[], think_open=thinking_left_open(prompt))
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return RenderedPrompt(token_ids=list(prompt), num_media=0, messages=[])

    def _reply_start(self, template_messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any], text: str,
                     offsets: list[tuple[int, int]]) -> int:
        """How much of this prompt the next turn's prompt will repeat: the conversation with a
        reply and a next user turn appended is rendered (templates render a reply after the last
        user turn differently from one before it), and the tokens wholly inside the text both
        renderings share are counted. Templates that render history differently from the
        generation prompt (Qwen's drop the `<think>` block of past replies) stop it at the
        reply's header; others reach the prompt's end."""
        try:
            history = self.tokenizer.apply_chat_template(
                [*template_messages, {"role": "assistant", "content": "\u2063"}, {"role": "user", "content": "\u2063"}],
                tools=tools,
                add_generation_prompt=False, tokenize=False, **kwargs)
        except Exception:
            return 0
        shared = common_prefix(text, history)
        n = 0
        while n < len(offsets) and offsets[n][1] <= shared:
            n += 1
        return n

    def _system_end(self, system: dict[str, Any], tools: Any, kwargs: dict[str, Any], ids: list[int]) -> int:
        """Where the system prompt's tokens end, whatever the template puts around it: the system
        message followed by two different probe user turns is rendered twice, and where the two
        renderings part is where a user turn's content starts (many templates refuse a system
        message alone). Both renderings are kept for the next request with this system prompt."""
        probes: list[list[int]] = []
        for probe in ("x", "y"):
            try:
                text = self.tokenizer.apply_chat_template([system, {"role": "user", "content": probe}], tools=tools,
                                                          add_generation_prompt=False, tokenize=False, **kwargs)
            except Exception:  # a template that cannot render it: no boundary
                return 0
            cached = self._system_ids.get(text)
            if cached is None:
                cached = list(self.tokenizer.encode(text, add_special_tokens=False))
                self._system_ids[text] = cached
                while len(self._system_ids) > self.system_cache_entries:
                    self._system_ids.popitem(last=False)
            else:
                self._system_ids.move_to_end(text)
            probes.append(cached)
        return min(common_prefix(probes[0], probes[1]), common_prefix(probes[0], ids))

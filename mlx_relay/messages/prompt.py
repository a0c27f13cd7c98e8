"""Messages of the prompt's front half: the Normalizer (`actors/normalizer.py`) renders a chat
request into tokens and, for a request with images or video, hands it on to the MediaRouter
(`actors/media_router.py`), which expands the media; the requester gets one `Prompt` back."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mlx_relay.cache.prefix_keys import MediaSpan
from mlx_relay.chat.grammar import OutputConstraint
from mlx_relay.chat.types import ChatMessage, ToolDef
from mlx_relay.media.tensors import VisionInputs


class Boundaries(msgspec.Struct, frozen=True):
    """Where the next requests stop repeating a prompt, in its tokens: the prefix cache snapshots
    there (`actors/prefix_cache_store.py`). Rendered once (`chat.prompt_render`), moved past a media
    expansion (`moved`), carried whole to the store."""

    # where the system prompt's parts end, ascending, the last where the whole (normalized, hoisted,
    # merged) system prompt ends: the prefix every turn of an agent's conversation shares, and the
    # parts before a later one a new conversation may share (an agent's own instructions and tools
    # before its session's environment); [] with no system prompt before other messages
    system: list[int] = []
    # how many leading tokens the next turn's prompt repeats (this prompt and its reply rendered as
    # history): the conversation's state there is what turn N+1 restores
    reply_start: int = 0
    # with tools declared, how many leading tokens the agent's next tool round repeats (this prompt,
    # a reply calling a tool and its result rendered as history; all of them when the template
    # renders the reply after the prompt, which it may then repeat as generated): what the loop's
    # next request restores (0: no tools)
    round_start: int = 0

    @property
    def system_end(self) -> int:
        return self.system[-1] if self.system else 0

    def moved(self, first_media: int | None, grown: int) -> Boundaries:
        """After a media expansion that grew the prompt by `grown` tokens, its first item expanded at
        token `first_media` (None: none): the system prompt's ends hold where no item precedes them;
        the reply's start (and the next tool round's) follows every message, so every expanded item
        precedes it and it moves by the whole expansion."""
        system = [s for s in self.system if first_media is None or s <= first_media]
        return Boundaries(system, self.reply_start + grown if self.reply_start else 0,
                          self.round_start + grown if self.round_start else 0)


class Render(msgspec.Struct, frozen=True):
    """Normalize, apply the chat template, tokenize (and route media). Reply: Prompt."""

    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    template_kwargs: dict[str, Any] = {}
    # /v1/completions: a raw prompt, tokenized as it is (no template, no normalization)
    raw_prompt: str | list[int] | None = None
    constraint: OutputConstraint | None = None  # response_format / required tool calls
    # a prompt longer than this is ContextLengthExceeded, found before tokenizing where the text
    # alone proves it (None: no bound)
    max_prompt_tokens: int | None = None
    chat_template: str | None = None  # the request's own template (only if the server allows it)


class RenderedPrompt(msgspec.Struct, frozen=True):
    """The template's output (`chat.prompt_render.PromptRenderer`), before media expansion."""

    token_ids: list[int]
    num_media: int
    messages: list[ChatMessage]  # normalized: the MediaRouter reads the media parts from these
    boundaries: Boundaries = Boundaries()
    # the prompt ends inside an open thinking block (the template opened `<think>`): the reply
    # starts with reasoning
    think_open: bool = False
    grammar: str | None = None  # llguidance grammar enforcing the request's constraint (validated)
    tool_format: str | None = None  # the model's tool-call syntax (`reply_parser.TOOL_FORMATS`)
    # tools declared with `tool_choice` "auto" whose calls the grammar holds only to being
    # well-formed (a schema it cannot enforce exactly: `chat.grammar.lazy_tool_grammar`)
    loose_tools: list[str] = []


class Route(msgspec.Struct, frozen=True):
    """Ask (Normalizer -> MediaRouter): a rendered prompt with one placeholder per media part of
    `messages` (in `media_parts(messages)` order). Reply: `Routed`."""

    messages: list[ChatMessage]
    prompt_tokens: list[int]
    boundaries: Boundaries = Boundaries()  # the rendered prompt's, moved by the expansion in the reply


class Routed(msgspec.Struct, frozen=True):
    """`text`: `prompt_tokens` unchanged, `vision` None. `vision`: placeholders expanded, pixels
    ready, the prompt's boundaries moved past the expansion (`Boundaries.moved`) and `media` the
    expanded items' spans keyed by content (None when they cannot be keyed)."""

    path: Literal["text", "vision"]
    prompt_tokens: list[int]
    vision: VisionInputs | None = None
    boundaries: Boundaries = Boundaries()
    media: list[MediaSpan] | None = []


class Prompt(msgspec.Struct, frozen=True):
    """The Normalizer's reply: what the model is prompted with and what the prefix cache, the
    decode path and the reply parser need to know about it."""

    token_ids: list[int]
    vision: VisionInputs | None = None  # the vision path (None: text)
    media: list[MediaSpan] | None = []  # None: media that cannot be keyed (no prefix reuse)
    boundaries: Boundaries = Boundaries()
    multi_turn: bool = False  # the conversation already has an assistant (or tool) message
    think_open: bool = False
    grammar: str | None = None
    tool_format: str | None = None
    loose_tools: list[str] = []  # as RenderedPrompt's


class DescribePrompts(msgspec.Struct, frozen=True):
    """Ask (the Relay, at boot): what the checkpoint's chat template supports. Reply: PromptFeatures."""


class PromptFeatures(msgspec.Struct, frozen=True):
    tool_format: str | None  # the tool-call syntax replies are parsed for (None: the template shows none)
    reasoning: bool  # the template writes thinking blocks (`<think>`)

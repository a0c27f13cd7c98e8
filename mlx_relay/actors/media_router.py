"""MediaRouter: sends a rendered request down the text path or the vision path.

It sits between the Normalizer (which renders one placeholder per image/video part) and the
executors. A request without media goes to the text path unchanged. For one with media it
checks the counts and the prompt's placeholders, fetches every item (data URLs, confined local
files, guarded http(s); see `mlx_relay.media.fetch`), then in a worker thread decodes them under
the size limits, runs the checkpoint's numpy image/video processors and expands each placeholder
to one token per vision token. The reply carries numpy arrays as bytes (`VisionInputs`); MLX is
never touched here. The processor is loaded in `on_start`, in a worker thread; a text-only
checkpoint has none, and a request with media is then refused with a 400.

Requests are handled one at a time (an ask's reply is the handler's return value); a request's
items are fetched concurrently, and all CPU work runs off the event loop.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Literal

import anyio
import msgspec

from mlx_relay.chat.normalize import media_parts
from mlx_relay.chat.types import ChatMessage
from mlx_relay.config import MediaConfig
from mlx_relay.errors import InvalidRequest
from mlx_relay.media.expand import check_placeholders
from mlx_relay.media.limits import check_media_counts
from mlx_relay.media.pipeline import fetch_all, media_kinds, prepare_vision
from mlx_relay.media.preprocess import VisionProcessor, checkpoint_has_vision, load_vision_processor
from mlx_relay.media.tensors import VisionInputs
from mlx_relay.runtime import Actor, ReplyStream

__all__ = ["MediaRouter", "Route", "Routed"]


class Route(msgspec.Struct, frozen=True):
    """Ask: route a rendered request. `prompt_tokens` hold one placeholder per media part of
    `messages`, in `media_parts(messages)` order. Reply: `Routed`."""

    messages: list[ChatMessage]
    prompt_tokens: list[int]


class Routed(msgspec.Struct, frozen=True):
    """`text`: `prompt_tokens` unchanged, `vision` None. `vision`: placeholders expanded, pixels ready."""

    path: Literal["text", "vision"]
    prompt_tokens: list[int]
    vision: VisionInputs | None = None


class MediaRouter(Actor):
    accepts = (Route,)

    def __init__(self, config: MediaConfig, model_path: Path) -> None:
        self.config = config
        self.model_path = model_path
        self.processor: VisionProcessor | None = None

    async def on_start(self) -> None:
        if checkpoint_has_vision(self.model_path):
            self.processor = await anyio.to_thread.run_sync(load_vision_processor, self.model_path)

    async def receive(self, msg: Route, stream: ReplyStream | None) -> Routed:
        parts = media_parts(msg.messages)
        if not parts:
            return Routed(path="text", prompt_tokens=msg.prompt_tokens, vision=None)
        if self.processor is None:
            raise InvalidRequest("this model has no vision tower: send text only", param="messages")
        kinds = media_kinds(parts)
        check_media_counts(kinds, self.config)
        check_placeholders(msg.prompt_tokens, kinds, self.processor.vocab)  # before any download
        fetched = await fetch_all(parts, self.config)
        tokens, vision = await anyio.to_thread.run_sync(
            partial(prepare_vision, self.processor, self.config, fetched, msg.prompt_tokens)
        )
        return Routed(path="vision", prompt_tokens=tokens, vision=vision)

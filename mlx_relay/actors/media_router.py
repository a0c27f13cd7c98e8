"""MediaRouter: sends a rendered request down the text path or the vision path.

    Normalizer --Route--> MediaRouter --> Routed (text, or vision: expanded, pixels ready)

The Normalizer renders one placeholder per image/video part and hands a request with media on
to it. A request without media goes to the text path unchanged. For one with media it checks
the counts and the prompt's placeholders, fetches every item (data URLs, confined local files,
guarded http(s); see `mlx_relay.media.fetch`), then in a worker thread decodes them under the
size limits, runs the model family's media processor (numpy, `media/processor.py`; which one is
the model type's, `media/served.py`) and expands each placeholder to one token per vision token.
The expansion moves the prompt's boundaries, so they are moved here: the system prompt's end (0
when a media item precedes it) and the reply's start, and each expanded item's span is keyed by
its content hash for the prefix cache. The reply carries numpy arrays as bytes (`VisionInputs`);
MLX is never touched here. The processor is loaded in `on_start`, in a worker thread; a text-only
checkpoint, or a VLM of a type no processor of ours serves, has none, and a request with media is
then refused with a 400 saying why (the one place that checks).

Requests are handled one at a time (an ask's reply is the handler's return value); a request's
items are fetched concurrently, and all CPU work runs off the event loop.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import anyio

from mlx_relay.cache.prefix_keys import MediaSpan
from mlx_relay.chat.normalize import media_parts
from mlx_relay.config import MediaConfig
from mlx_relay.errors import InvalidRequest
from mlx_relay.media.limits import check_media_counts
from mlx_relay.media.pipeline import fetch_all, media_kinds, prepare_vision
from mlx_relay.media.processor import MediaProcessor
from mlx_relay.media.served import load_media_processor, unserved_vision
from mlx_relay.media.tensors import VisionInputs
from mlx_relay.messages.prompt import Route, Routed
from mlx_relay.runtime import Actor, ReplyStream

__all__ = ["MediaRouter", "Route", "Routed"]


class MediaRouter(Actor):
    accepts = (Route,)

    def __init__(self, config: MediaConfig, model_path: Path) -> None:
        self.config = config
        self.model_path = model_path
        self.processor: MediaProcessor | None = None
        self.unserved: str | None = None  # why the checkpoint's vision tower is not served

    async def on_start(self) -> None:
        self.unserved = unserved_vision(self.model_path)
        self.processor = await anyio.to_thread.run_sync(load_media_processor, self.model_path)

    async def receive(self, msg: Route, stream: ReplyStream | None) -> Routed:
        parts = media_parts(msg.messages)
        if not parts:
            return Routed(path="text", prompt_tokens=msg.prompt_tokens, vision=None, boundaries=msg.boundaries)
        if self.processor is None:
            raise InvalidRequest(self.unserved or "this model has no vision tower: send text only", param="messages")
        kinds = media_kinds(parts)
        check_media_counts(kinds, self.config)
        self.processor.check_placeholders(msg.prompt_tokens, kinds)  # before any download
        fetched = await fetch_all(parts, self.config)
        tokens, vision = await anyio.to_thread.run_sync(
            partial(prepare_vision, self.processor, self.config, fetched, msg.prompt_tokens)
        )
        return routed_vision(msg, tokens, vision)


def routed_vision(msg: Route, tokens: list[int], vision: VisionInputs) -> Routed:
    """The expanded prompt with its boundaries moved past the expansion (`Boundaries.moved`)."""
    media: list[MediaSpan] | None = None
    if len(vision.spans) == len(vision.content_hashes):  # every item keyed: its prefix can be reused
        media = [MediaSpan(a, b, h) for (a, b), h in zip(vision.spans, vision.content_hashes, strict=True)]
    boundaries = msg.boundaries.moved(vision.spans[0][0] if vision.spans else None,
                                      len(tokens) - len(msg.prompt_tokens))
    return Routed(path="vision", prompt_tokens=tokens, vision=vision, boundaries=boundaries, media=media)

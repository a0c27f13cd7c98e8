"""The route skeleton every wire format's routes build on (`FormatRoutes`): decode the body,
check the model, and answer through `streaming.respond` (stream the encoder's frames or collect
one body) with the model in use. A format's `routes.py` subclasses it and adds only its own steps: the wire body into
the neutral `ChatRequest`s (its `request.py`), its response id, its encoder and collector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from mlx_relay.config import ServerConfig
from mlx_relay.http.body import decode_body
from mlx_relay.http.served import Served
from mlx_relay.http.streaming import Collect, SSEEncoder, respond
from mlx_relay.service import ChatRequest

B = TypeVar("B")


class FormatRoutes:
    """What a format's routes get from the app: the config and what it serves (`served()`, the
    one model or the pool; `NotReady` until the app has booted it)."""

    def __init__(self, config: ServerConfig, served: Callable[[], Served]) -> None:
        self.config = config
        self.served = served

    def resolve(self, model: str | None) -> str:
        """A request's `model` -> the served name, or `ModelNotFound` (404) naming what is served."""
        return self.served().resolve(model)

    async def decode(self, request: Request, body_type: type[B]) -> B:
        """The request's body as `body_type` (`http/body.py`: every bad body a 4xx)."""
        return decode_body(await request.body(), body_type, self.config.limits.max_json_depth)

    async def respond(self, request: Request, reqs: list[ChatRequest], rid: str, *, model: str, stream: bool,
                      encoder: SSEEncoder, collect: Collect, raw: bool = False) -> Response:
        """Open the replies of `reqs` and stream them through `encoder` or collect them with `collect`."""
        return await respond(request, self.served().use(model), reqs, rid, model=model, stream=stream,
                             encoder=encoder,
                             collect=collect, keepalive_s=self.config.sse_keepalive_s, raw=raw)

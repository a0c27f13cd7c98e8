"""mlx-relay: an inference server for MLX vision-language models.

`Relay` is the in-process API; `mlx-relay serve` (mlx_relay.cli) the HTTP server. Importing the
package loads nothing else: `Relay` (and with it MLX) is imported on first use, so modules that
never touch MLX (the runtime, the HTTP types, the template sandbox's process) stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_relay.chat.reply import ChatReply
    from mlx_relay.relay import Relay

__all__ = ["ChatReply", "Relay"]


def __getattr__(name: str) -> Any:
    if name == "Relay":
        from mlx_relay import relay

        return relay.Relay
    if name == "ChatReply":
        from mlx_relay.chat import reply

        return reply.ChatReply
    raise AttributeError(f"module 'mlx_relay' has no attribute {name!r}")

"""mlx-relay: an inference server for MLX vision-language models.

`Relay` is the in-process API; `mlx-relay serve` (mlx_relay.cli) the HTTP server.
"""

from mlx_relay.relay import ChatResult, Relay

__all__ = ["ChatResult", "Relay"]

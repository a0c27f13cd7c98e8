"""The embedded default model that `mlx-relay serve` (and `Relay.start()`) serve without a MODEL:
the small trained checkpoint shipped in the package (`mlx_relay/models/relay-tiny-agent`: a
Qwen3.5-style hybrid with an MTP head, trained on an agent curriculum to think, call declared
tools, answer tool results and write JSON). `relay-tiny-coder` (trained on the Python standard
library) is the repository's, for the tests and benchmarks (`models/relay-tiny-coder`, not in the
package)."""

from __future__ import annotations

from pathlib import Path

from mlx_relay.errors import ModelLoadError

DEFAULT_MODEL_NAME = "relay-tiny-agent"


def default_model_path() -> Path:
    path = Path(__file__).resolve().parent / "models" / DEFAULT_MODEL_NAME
    if not (path / "model.safetensors").is_file():
        raise ModelLoadError(f"the embedded default model is missing from {path}: reinstall mlx-relay or name a MODEL")
    return path

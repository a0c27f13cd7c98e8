"""mlx-lm's tool-call parsers (Qwen3-Coder XML and Hermes-style JSON), loaded on first use.

The parsers are pure Python, but importing anything under `mlx_lm` runs its package init, which
loads MLX. They are imported when the first tool call is parsed, so the front half of the server
(the HTTP app, the runtime, every actor but the GPUExecutor) imports without MLX
(tests/test_layering.py checks that). The behaviour we rely on is pinned by
tests/test_reply_parser.py.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def qwen3_coder() -> ModuleType:
    return importlib.import_module("mlx_lm.tool_parsers.qwen3_coder")


@functools.cache
def json_tools() -> ModuleType:
    return importlib.import_module("mlx_lm.tool_parsers.json_tools")

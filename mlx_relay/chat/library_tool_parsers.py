"""mlx-lm's tool-call parsers (Qwen3-Coder XML and Hermes-style JSON), loaded on first use.

The parsers are pure Python modules (their own imports: the standard library and `regex`), but
importing anything under `mlx_lm` runs its package init, which loads MLX, and the server's
process never loads MLX when its engine runs in a process of its own (tests/test_layering.py).
So each parser's source file, found where mlx-lm is installed, is loaded as a module of its own,
without the package around it. The behaviour we rely on is pinned by tests/test_reply_parser.py.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType


def _parser(name: str) -> ModuleType:
    """`mlx_lm.tool_parsers.<name>`, loaded from its file without importing `mlx_lm`."""
    package = importlib.util.find_spec("mlx_lm")  # finds the package; runs none of it
    if package is None or not package.submodule_search_locations:
        raise ModuleNotFoundError("mlx_lm is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "tool_parsers" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"mlx_relay.chat._mlx_lm_tool_parsers.{name}", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no mlx-lm tool parser at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def qwen3_coder() -> ModuleType:
    return _parser("qwen3_coder")


@functools.cache
def json_tools() -> ModuleType:
    return _parser("json_tools")

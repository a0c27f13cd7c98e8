"""Start `mlx_vlm.server` with MLX memory and buffer-cache limits set for its process.

The GPU runner alternates between our server and mlx_vlm.server on one GPU; each process has
to stay within its share. MLX's limits are process-wide settings of its public API
(`mx.set_memory_limit`, `mx.set_cache_limit`), set here before the server module runs; the
server itself is untouched. Usage:
    python3 benchmarks/gpu/mlx_vlm_server_capped.py MEMORY_GB CACHE_GB -- <mlx_vlm.server args>
"""

from __future__ import annotations

import runpy
import sys

import mlx.core as mx


def main() -> None:
    memory_gb, cache_gb, sep, *rest = sys.argv[1:]
    if sep != "--":
        raise SystemExit(__doc__)
    mx.set_memory_limit(int(float(memory_gb) * (1 << 30)))
    mx.set_cache_limit(int(float(cache_gb) * (1 << 30)))
    sys.argv = ["mlx_vlm.server", *rest]
    runpy.run_module("mlx_vlm.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

"""Does MLX give freed device memory back (CUDA backend)? The question behind the 139 GB still
in use after a 64-stream burst (benchmarks/results/gpu-h200-2026-11-24d/memory.txt).

Allocates `--gb` GB in 1 GB arrays, frees them, then reads the device's memory in use
(nvidia-smi) and MLX's own account (active / cache) after each of: the arrays freed,
`mx.clear_cache()`, `mx.synchronize()`, and a small op evaluated afterwards.

    python benchmarks/gpu/memory_release_probe.py [--gb 40]
"""

from __future__ import annotations

import argparse
import subprocess

import mlx.core as mx


def used_mib() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def report(label: str) -> None:
    print(f"{label:<28} device {used_mib():>12}   mlx active {mx.get_active_memory() / 1e9:6.2f} GB"
          f"   cache {mx.get_cache_memory() / 1e9:6.2f} GB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=int, default=40)
    args = ap.parse_args()
    report("start")
    arrays = [mx.ones((1 << 28,), dtype=mx.float32) for _ in range(args.gb)]  # 1 GiB each
    mx.eval(*arrays)
    report(f"{args.gb} GB held")
    del arrays
    report("freed")
    mx.clear_cache()
    report("clear_cache")
    mx.synchronize()
    report("synchronize")
    mx.eval(mx.ones((16,)) + 1)
    mx.synchronize()
    report("a small op, synchronize")


if __name__ == "__main__":
    main()

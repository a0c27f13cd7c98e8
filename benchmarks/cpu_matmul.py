"""MLX's CPU float32 matmul as shipped and under the CPU BLAS preload (`tools/cpu_blas/`), each in a
process of its own (the preload is a process's from its start):

    python benchmarks/cpu_matmul.py [--shape 256,256,1024] [--repeats 20]

Prints the median milliseconds of an M x K by K x N matmul (evaluated) both ways and their ratio.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TIMED = """
import statistics, sys, time
import mlx.core as mx
m, k, n, repeats = (int(v) for v in sys.argv[1:5])
a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
mx.eval(a, b, a @ b)
times = []
for _ in range(repeats):
    t0 = time.perf_counter()
    mx.eval(a @ b)
    times.append((time.perf_counter() - t0) * 1000)
print(statistics.median(times))
"""


def median_ms(shape: list[int], repeats: int, preload: Path | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload is not None:
        env |= {"LD_PRELOAD": str(preload), "OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", "1")}
    out = subprocess.run([sys.executable, "-c", TIMED, *map(str, shape), str(repeats)], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="256,256,1024", help="M,K,N")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    shape = [int(v) for v in args.shape.split(",")]
    shipped = median_ms(shape, args.repeats, None)
    print(f"{'x'.join(map(str, shape))} float32: {shipped:.2f} ms as shipped")
    # the preload as `make` builds it (its path, or nothing where it does not apply)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "cpu_blas" / "build.py"), str(ROOT / ".venv" / "lib")],
                         capture_output=True, text=True, check=True).stdout.strip()
    built = Path(out) if out else None
    if built is None:
        print("no preload applies here")
        return
    preloaded = median_ms(shape, args.repeats, built)
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "1")
    print(f"{preloaded:.2f} ms under the preload ({threads} OpenBLAS thread(s)): {shipped / preloaded:.1f}x")


if __name__ == "__main__":
    main()

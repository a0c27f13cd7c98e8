"""The first step of each new shape of a mixed step against two forwards (issue 43.3), on a GPU:

    python benchmarks/gpu/mixed_shape_probe.py MODEL

In one process (`benchmarks/mixed_step.py`'s `Bench`: 8 or 4 decoding rows, a prompt 2,048 tokens
in), each line one step, evaluated and synchronized: a shape's first step and its second, for
two forwards (`two N`: the decode step, then an N-token chunk) and one (`mixed N bR`: the rows'
step riding in the chunk's forward, R rows). A first step much slower than the second pays a
per-shape setup; `mixed 1016 b8` joins 1,024 positions (as `two 1024`'s chunk) and `two 1032` a
chunk of the positions `mixed 1024 b8` joined, so they show which parts' shapes pay.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mixed_step import Bench

from mlx_relay.engine.models.loader import load_model

STEPS = [("two 1024", 8, "two", 1024), ("two 1024 again", 8, "two", 1024),
         ("mixed 1024 b8", 8, "mixed", 1024), ("mixed 1024 b8 again", 8, "mixed", 1024),
         ("mixed 1024 b4", 4, "mixed", 1024), ("mixed 1024 b4 again", 4, "mixed", 1024),
         ("mixed 1016 b8 (N=1024)", 8, "mixed", 1016), ("two 1032 (N=1032)", 8, "two", 1032),
         ("mixed 1032 b8", 8, "mixed", 1032), ("two 512", 8, "two", 512), ("two 512 again", 8, "two", 512),
         ("mixed 512 b8", 8, "mixed", 512), ("mixed 256 b8", 8, "mixed", 256), ("two 256", 8, "two", 256)]


def main() -> None:
    lm = load_model(Path(sys.argv[1])).model.language_model
    benches = {8: Bench(lm, 8, 2048, 0), 4: Bench(lm, 4, 2048, 1)}
    for rows, bench in benches.items():
        print(f"{f'decode b{rows} first':28s} {bench.run('decode', 1):8.1f} ms", flush=True)
    for label, rows, mode, n in STEPS:
        mx.synchronize()
        print(f"{label:28s} {benches[rows].run(mode, n):8.1f} ms", flush=True)


if __name__ == "__main__":
    main()

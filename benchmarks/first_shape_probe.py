"""Which new shapes stall (issue 17: "a prompt length seen for the first time stalls 47-58 s on
the GPU"): times the first and second forward of the language model at prompt lengths and batch
sizes not seen before in this process, for mlx-vlm's prefill and for our compiled decode step.

A first call much slower than the second means that shape compiled kernels (MLX JIT-compiles
kernels on CUDA, and caches them by name on disk); the pattern across lengths tells whether
kernels are specialised by length (every new length stalls) or only by a few properties
(a power of two, a multiple of some block, the batch size).

    python benchmarks/first_shape_probe.py [MODEL_DIR] [--lengths 64,65,100,128,200,256,257,512,777]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx

from mlx_relay.engine.lanes.decode_state import DecodeState
from mlx_relay.engine.lanes.decode_step import DecodeStep
from mlx_relay.engine.memory.batch_caches import as_batch_caches
from mlx_relay.engine.models.loader import load_model
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path


def timed(fn: object) -> float:
    t = time.perf_counter()
    mx.eval(fn())  # type: ignore[operator]
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--lengths", default="64,65,100,128,200,256,257,512,777")
    parser.add_argument("--batches", default="1,2,3,8")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(args.model) if args.model else fixture_path(FixtureSpec("bf16", 0))
    lm = load_model(model).model.language_model
    rows = []

    def prefill(b: int, n: int) -> mx.array:
        cache = lm.make_cache()
        pos = mx.broadcast_to(mx.arange(n, dtype=mx.int32)[None, None, :], (3, b, n))
        out = lm(mx.ones((b, n), dtype=mx.int32), cache=cache, position_ids=pos)
        return out.logits[:, -1, :]

    for n in (int(x) for x in args.lengths.split(",")):
        first, second = timed(lambda n=n: prefill(1, n)), timed(lambda n=n: prefill(1, n))
        rows.append({"what": "prefill", "batch": 1, "length": n, "first_s": first, "second_s": second})
        print(f"prefill B=1 T={n}: first {first:.2f}s second {second:.3f}s", flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        first, second = timed(lambda b=b: prefill(b, 100)), timed(lambda b=b: prefill(b, 100))
        rows.append({"what": "prefill", "batch": b, "length": 100, "first_s": first, "second_s": second})
        print(f"prefill B={b} T=100: first {first:.2f}s second {second:.3f}s", flush=True)
    step = DecodeStep(lm)
    cache = lm.make_cache()
    lm(mx.ones((1, 8), dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    for b in (int(x) for x in args.batches.split(",")):
        def decode(b: int = b) -> mx.array:
            state = DecodeState.from_batch_caches(as_batch_caches(cache), [0])
            state.pad_to(b)
            return step(mx.zeros((b,), dtype=mx.int32), state)
        first, second = timed(decode), timed(decode)
        rows.append({"what": "compiled decode", "batch": b, "first_s": first, "second_s": second})
        print(f"compiled decode B={b}: first {first:.2f}s second {second:.3f}s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(model), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

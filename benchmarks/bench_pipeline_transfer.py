"""What a pipelined step spends moving data between ranks, measured alone (docs/pipeline.md).

    mlx.launch -n 2 --backend nccl -- python3 benchmarks/bench_pipeline_transfer.py --hidden 2048
    mlx.launch -n 2 --backend ring -- python benchmarks/bench_pipeline_transfer.py     # CPU, loopback

Per step a pipeline of two ranks runs three collectives besides its layers: the step's commands
(`pipeline_sync.share_commands`: a 4096-byte frame through `all_sum`, read back on the host), the
hidden state across the stage boundary (`Stage.send` / `Stage.receive`: one `all_sum` of
[rows, 1, hidden] with the collective transfer, send/recv with p2p) and the last stage's hidden
state on every rank (`Stage.share`: an `all_gather`). Each is timed here on its own, evaluated
once per iteration as a step evaluates it, through the same functions the engine calls, at the
decode shapes of batch 1 and 16 (and a 2048-token prefill chunk). Rank 0 prints one line per
case (median and min-max microseconds over `--iters`) and writes `--out` JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import mlx.core as mx

from mlx_relay.engine.hosting.pipeline_sync import StepOnce, share_commands
from mlx_relay.engine.models.pipeline_stage import Stage, default_transfer


def timed(fn: Callable[[], object], iters: int) -> list[float]:
    for _ in range(5):
        fn()
    out = []
    for _ in range(iters):
        tic = time.perf_counter()
        fn()
        out.append((time.perf_counter() - tic) * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--chunk", type=int, default=2048, help="a prefill chunk's tokens (one row)")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--transfer", choices=["auto", "p2p", "collective"], default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    group = mx.distributed.init(strict=True)
    rank, size = group.rank(), group.size()
    transfer = default_transfer() if args.transfer == "auto" else args.transfer
    stage = Stage(group, rank, size, 0, 1, transfer)
    results: dict[str, list[float]] = {}
    results["commands frame (4096 B all_sum, to host)"] = timed(
        lambda: share_commands(group, [StepOnce()] if rank == 0 else None), args.iters)
    shapes = [(int(r), 1) for r in args.rows.split(",")] + [(1, args.chunk)]
    for rows, tokens in shapes:
        h = mx.random.normal((rows, tokens, args.hidden)).astype(mx.bfloat16)
        mx.eval(h)

        def boundary(h: mx.array = h) -> None:
            mx.eval(stage.receive(h) if not stage.first else stage.send(h))

        def share(h: mx.array = h) -> None:
            mx.eval(stage.share(h))

        results[f"boundary [{rows}, {tokens}, {args.hidden}] bf16 ({transfer})"] = timed(boundary, args.iters)
        results[f"share [{rows}, {tokens}, {args.hidden}] bf16 (all_gather)"] = timed(share, args.iters)
    if rank == 0:
        report = {"ranks": size, "transfer": transfer, "device": str(mx.default_device()), "mlx": mx.__version__,
                  "iters": args.iters, "us": {}}
        for name, us in results.items():
            med = statistics.median(us)
            report["us"][name] = {"median": med, "min": min(us), "max": max(us)}
            print(f"{name}: {med:.1f} us (min {min(us):.1f}, max {max(us):.1f})", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a step's device time goes, kernel by kernel (issue 43.3), on a GPU (a speculation lane's
step: `bench_speculation.py --profile`):

    python benchmarks/gpu/kernel_profile.py MODEL [--rows 8] [--context 16384] [--slices 64,256,512]
        [--steps 4] [--top 25] [--out kernel_profile.json]

One process (`benchmarks/mixed_step.py`'s `Bench`): per case, a step's shape warmed once, then
`--steps` steps recorded by CUPTI through `torch.profiler` (the machine's torch; CUPTI's activity
records cover every kernel of the process's CUDA context, MLX's included). Cases: `decode` (the
compiled decode step of `--rows` rows, and of one row: `decode b1`), `chunk N` (an N-token prefill
chunk alone), `mixed N` (the rows riding in the chunk's forward: the plain lane's step; `eager mixed N`
the same with no part compiled), and at
batch 1 an MTP round of `--mtp-block` and the head-free round of width 1 (issue 45.3: against
`decode b1`).

Per case it prints the step's wall time, the sum of its kernels' device time (`busy`), their count
and the gaps (wall - busy: the device idle, waiting for the host or for launches), then the `--top`
kernels by device time (name, launches a step, microseconds a step, share). What it decides: a step
whose busy time is near its wall time is bound by its kernels (make them faster, fewer); one with
wide gaps by the host or by launches (compile it, capture it, move the work off the host).

Off a GPU (or with no torch) it says so and exits 0: nothing to record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_prefill import card, commit
from mixed_step import Bench
from step_recorder import by_kernel, profiler, short

from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.dense_copies import add_dense_copies
from mlx_relay.engine.models.loader import load_model


class Steps(Protocol):
    def run(self, mode: str, n: int) -> float: ...


def record(bench: Steps, mode: str, n: int, steps: int, top: int) -> dict[str, Any]:
    bench.run(mode, n)  # the shape's first step: compiles, plans
    prof = profiler()
    assert prof is not None
    walls = []
    with prof:
        for _ in range(steps):
            walls.append(bench.run(mode, n))
    by_name = by_kernel(prof)
    busy = sum(sum(v) for v in by_name.values()) / steps / 1000
    launches = sum(len(v) for v in by_name.values()) / steps
    wall = statistics.median(walls)
    rows = sorted(((short(k), len(v) / steps, sum(v) / steps) for k, v in by_name.items()),
                  key=lambda r: -r[2])
    return {"mode": mode, "tokens": n, "wall_ms": wall, "walls_ms": walls, "busy_ms": busy,
            "launches": launches, "top": [{"kernel": k, "launches": c, "us": us} for k, c, us in rows[:top]]}


class RoundBench:
    """A compiled speculation round at batch 1 as `MTPLane` runs it (`mtp_step.MTPStep` over one
    prefilled row): the head's block (`width` 0) or the head-free round verifying `width - 1` host
    drafts (width 1: a row with nothing to verify). `run` times one round, its counts read back
    and committed as the lane does (issue 45.3: a round against a plain step)."""

    def __init__(self, model: Path, lm: Any, block: int, width: int = 0) -> None:
        from mlx_relay.engine.lanes.mtp_head import MTPHead
        from mlx_relay.engine.lanes.mtp_state import MTPState
        from mlx_relay.engine.lanes.mtp_step import HostDrafts, MTPStep

        head = MTPHead.load(model, lm, exact=False)
        prompt = list(range(10, 74))
        self.state, _ = MTPState.prefilled(lm, head, prompt)
        self.step = MTPStep(lm, head, block_size=block, eos_token_ids=[])
        self.drafts = HostDrafts(width, [prompt[:width - 1]], [False]) if width else None

    def run(self, mode: str, n: int) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        r = self.step(self.state, [1 << 20], self.drafts)
        mx.eval(r.targets, r.accepted, r.committed, self.state.arrays())
        self.step.advance(self.state, r.committed.tolist())
        mx.synchronize()
        return (time.perf_counter() - t0) * 1000


def show(case: dict[str, Any]) -> None:
    label = case["label"]
    print(f"\n== {label}: wall {case['wall_ms']:.1f} ms, kernels busy {case['busy_ms']:.1f} ms "
          f"({case['busy_ms'] / case['wall_ms']:.0%}), {case['launches']:.0f} launches, "
          f"gaps {case['wall_ms'] - case['busy_ms']:.1f} ms", flush=True)
    for row in case["top"]:
        share = row["us"] / 10 / case["busy_ms"]
        print(f"  {row['us']:9.0f} us {row['launches']:6.0f}x  {share:5.1f}%  {row['kernel']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--slices", default="64,256,512")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--experts", default="kernel", choices=("kernel", "narrow", "dequantize", "library"),
                    help="the chunk's routed experts (the server's --prefill-experts)")
    ap.add_argument("--min-routes", type=int, default=None,
                    help="(token, expert) pairs from which the experts run grouped (PrefillOptions.grouped_min_routes)")
    ap.add_argument("--mtp-block", type=int, default=2,
                    help="also an MTP round at this block and the head-free round of width 1, batch 1 (0: none)")
    ap.add_argument("--dense-16bit", action="store_true", help="16-bit copies of the dense projections (--dense-16bit)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if profiler() is None:
        print("kernel_profile: no torch with a CUDA GPU here; nothing to record")
        return
    t0 = time.perf_counter()
    lm = load_model(Path(args.model)).model.language_model
    if args.dense_16bit:
        print(f"16-bit dense copies: {add_dense_copies(family_of(lm).layers(lm)) / 1e9:.2f} GB")
    bench, lone = Bench(lm, args.rows, args.context, 0, args.experts, args.min_routes), Bench(lm, 1, 64, 1)
    cases = [dict(record(bench, "decode", 1, args.steps, args.top), label=f"decode b{bench.rows}"),
             dict(record(lone, "decode", 1, args.steps, args.top), label="decode b1")]
    for n in (int(s) for s in args.slices.split(",")):
        cases.append(dict(record(bench, "chunk", n, args.steps, args.top), label=f"chunk {n}"))
        cases.append(dict(record(bench, "mixed", n, args.steps, args.top), label=f"mixed {n} b{bench.rows}"))
        cases.append(dict(record(bench, "eager", n, args.steps, args.top), label=f"eager mixed {n} b{bench.rows}"))
    if args.mtp_block:
        model = Path(args.model)
        cases.append(dict(record(RoundBench(model, lm, args.mtp_block), "round", 1, args.steps, args.top),
                          label=f"MTP round b1, block {args.mtp_block}"))
        cases.append(dict(record(RoundBench(model, lm, args.mtp_block, 1), "round", 1, args.steps, args.top),
                          label="head-free round b1, width 1"))
    for case in cases:
        show(case)
    print(f"\n({time.perf_counter() - t0:.0f} s in all)")
    if args.out:
        args.out.write_text(json.dumps({"commit": commit(), "card": card()[0], "rows": bench.rows,
                                        "context": args.context, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()

"""A draft model's round, through the library's eager forward and through the engine's compiled step
(issue 45.1; `engine/speculation/draft_model.py`, `draft_compiled.py`), with nothing else running.

    python benchmarks/bench_draft_step.py DRAFT_MODEL [--prompt 512] [--drafts 8] [--rounds 64] [--repeats 3]

One row: its prompt read, then `--rounds` rounds of `--drafts` drafts, the row taking half of each
round's drafts and a token of its own (the proposer's `extend`), as a round the target verified
would. Per path: milliseconds a round and a draft token (median of `--repeats`, alternating paths),
and whether both paths drafted the same tokens. Where the draft's library forward costs more than
its compiled step, a round of the eager path is what a verify waits for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_relay.engine.scoring.draft_library import load_draft
from mlx_relay.engine.speculation.draft_model import DraftModel


def rounds(model: DraftModel, prompt: list[int], drafts: int, n: int) -> tuple[float, list[list[int]]]:
    """Seconds for `n` rounds after the prompt is read (its first round untimed), and the drafts."""
    row = model.proposals(prompt)
    while not row.ready():
        pass
    first = row.propose(drafts)
    row.extend([*first[:drafts // 2], 7])
    got = []
    mx.synchronize()
    t0 = time.perf_counter()
    for k in range(n):
        d = row.propose(drafts)
        got.append(d)
        row.extend([*d[:drafts // 2], 11 + k % 50])
    mx.synchronize()
    return time.perf_counter() - t0, got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("draft", type=Path)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--drafts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    loaded = load_draft(args.draft)
    prompt = [(13 * k + 5) % 1000 + 3 for k in range(args.prompt)]
    paths = {"compiled": DraftModel(loaded, args.draft, args.drafts, compiled=True),
             "eager": DraftModel(loaded, args.draft, args.drafts, compiled=False)}
    if not paths["compiled"].info.compiled:
        raise SystemExit(f"{args.draft}: its family is not one the engine's decode step serves")
    times: dict[str, list[float]] = {k: [] for k in paths}
    drafted: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, model in paths.items():
            seconds, drafted[name] = rounds(model, prompt, args.drafts, args.rounds)
            times[name].append(seconds)
    report: dict[str, Any] = {"draft": str(args.draft), "device": str(mx.default_device()), "prompt": args.prompt,
                              "drafts": args.drafts, "rounds": args.rounds, "same_drafts":
                              drafted["compiled"] == drafted["eager"]}
    for name, ts in times.items():
        ms = statistics.median(ts) * 1000 / args.rounds
        report[name] = {"ms_a_round": round(ms, 3), "ms_a_draft": round(ms / args.drafts, 3),
                        "spread_ms_a_round": [round(t * 1000 / args.rounds, 3) for t in ts]}
        print(f"{name}: {ms:.2f} ms a round of {args.drafts} drafts ({ms / args.drafts:.3f} ms a draft)")
    print(f"eager / compiled: {report['eager']['ms_a_round'] / report['compiled']['ms_a_round']:.2f}x; "
          f"same drafts: {report['same_drafts']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

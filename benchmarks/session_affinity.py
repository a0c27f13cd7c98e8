"""How much of each agent session's second turn came from the prefix cache, from a `mlx-relay bench`
report (its `bench.json`) of an agent-session scenario (docs/cluster.md).

    python benchmarks/session_affinity.py RESULTS/bench.json [--target two] [--at-least 0.9]

Behind a cache-aware router the second turn must land on the replica that ran the first, so its
`cached_tokens` cover (nearly) all of the first turn's prompt: this prints, per target, how many
sessions' second turns were cached at least `--at-least` of their first turn's prompt tokens, and
the smallest share.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--target", default=None, help="only this target's requests (default: each)")
    parser.add_argument("--at-least", type=float, default=0.9)
    args = parser.parse_args()
    with open(args.report) as f:
        records = json.load(f)["records"]
    turns: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for r in records:
        if args.target is not None and r["target"] != args.target:
            continue
        session, _, turn = r["request_id"].rpartition(".t")
        turns[(r["target"], f"{r['level']}/{session}")][int(turn)] = r
    by_target: dict[str, list[float]] = defaultdict(list)
    for (target, _), t in turns.items():
        if 0 in t and 1 in t and t[0].get("prompt_tokens") and t[1].get("cached_tokens") is not None:
            by_target[target].append(t[1]["cached_tokens"] / t[0]["prompt_tokens"])
    for target, shares in sorted(by_target.items()):
        hits = sum(s >= args.at_least for s in shares)
        print(f"{target}: {hits} of {len(shares)} sessions' second turns cached >= {args.at_least:.0%} of the "
              f"first turn's prompt (smallest share {min(shares):.3f})")


if __name__ == "__main__":
    main()

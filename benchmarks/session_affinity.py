"""How much of each agent session's second turn came from the prefix cache, from a `mlx-relay bench`
report (its `bench.json`) of an agent-session scenario (docs/cluster.md).

    python benchmarks/session_affinity.py RESULTS/bench.json [--target two] [--at-least 0.9]

Behind a cache-aware router the second turn must land on the replica that ran the first, so its
`cached_tokens` cover (nearly) all of the first turn's prompt: this prints, per target, how many
sessions' second turns were cached at least `--at-least` of their first turn's prompt tokens, and
the smallest share. With `--log` (a cluster's stderr: each replica's request lines carry its name,
`--log-name replica-N`, and the harness's `TARGET/REQUEST` id), each session whose second turn missed is
named with the replica that ran each of its turns and what each had cached: the same replica with
nothing cached is a snapshot gone (evicted, or never taken); another replica is the router's choice.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def request_lines(path: str) -> dict[str, dict[str, str]]:
    """Request id -> the request log line's fields, with `server` its replica (text-format lines of
    `mlx_relay.requests` that start with a server name)."""
    out: dict[str, dict[str, str]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            head, sep, rest = line.partition(" mlx_relay.requests: ")
            if not sep or len(head.split()) != 2:  # "NAME LEVEL" before the logger
                continue
            fields = {k: json.loads(v) if v.startswith('"') else v for k, v in _FIELD.findall(rest)}
            if "request_id" in fields:
                out[fields["request_id"]] = {**fields, "server": head.split()[0]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--target", default=None, help="only this target's requests (default: each)")
    parser.add_argument("--at-least", type=float, default=0.9)
    parser.add_argument("--log", default=None, help="the cluster's log: name the replicas of each missed session")
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
    missed: list[tuple[str, dict[int, dict]]] = []
    for (target, session), t in turns.items():
        if 0 in t and 1 in t and t[0].get("prompt_tokens") and t[1].get("cached_tokens") is not None:
            by_target[target].append(t[1]["cached_tokens"] / t[0]["prompt_tokens"])
            if by_target[target][-1] < args.at_least:
                missed.append((f"{target} {session}", t))
    if not by_target:  # (a run too short for any session's second turn: said, not silent)
        print(f"no session with both turns measured in {len(records)} records")
    for target, shares in sorted(by_target.items()):
        hits = sum(s >= args.at_least for s in shares)
        print(f"{target}: {hits} of {len(shares)} sessions' second turns cached >= {args.at_least:.0%} of the "
              f"first turn's prompt (smallest share {min(shares):.3f})")
    if args.log is not None:
        logged = request_lines(args.log)
        for name, t in missed:
            where = [logged.get(f"{t[k]['target']}/{t[k]['request_id']}", {}) for k in (0, 1)]  # the harness's id
            servers = [w.get("server", "?") for w in where]
            cause = ("not in the log" if "?" in servers else "the router sent it elsewhere"
                     if servers[0] != servers[1] else "same replica, its snapshot gone")
            first, second = where
            print(f"  missed {name}: turn 0 on {servers[0]} (prompt {first.get('prompt_tokens')}), turn 1 on "
                  f"{servers[1]} (prompt {second.get('prompt_tokens')}, cached {second.get('cached_tokens')}): {cause}")


if __name__ == "__main__":
    main()

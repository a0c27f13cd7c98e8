"""Where a decoding loop's host time goes, from py-spy's collapsed stacks (device_steps.sh's `hostprof`
job, issue 45.2: the context lane's one-token round took ~4 ms more host a token than the plain step on
an H200 while launching fewer kernels, `benchmarks/results/gpu-h200-2026-11-29f/`).

    python benchmarks/gpu/host_split.py hostprof_none.txt hostprof_context.txt [--top 15]

Each file: py-spy's `--format raw` output (a line a distinct stack: frames joined by ';', then its
sample count), recorded with `--native` so MLX's C++ frames appear under the Python call that made
them. For each file, the samples whose stack passes through the engine step's lane code (`LOOP`:
the plain lane's batch step, the MTP lane's compiled round), the warm-up's and imports' left out, are
split three ways: by the lane's Python frame they pass through (the innermost of `LOOP`), by the first
named frame below it (what that call spent its time in: graph building, `async_eval`, a read), and by
their leaf frame (where the host was when sampled: a lock, a CUDA driver call, the allocator). Shares
are of the loop's samples.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

#: the lane code a decoding step runs through (file names as py-spy prints them)
LOOP = ("decode_batch.py", "decode_step.py", "mtp_compiled.py", "mtp_step.py")
#: a stack through the engine's warm-up or an import is not the loop's (`engine/lanes/warmup.py`, the
#: lanes' `warm*`, a module's body run by an import)
NOT_LOOP = re.compile(r"\bwarm\w*|warmup\.py|_find_and_load")
_SAMPLE = re.compile(r"^(.*) (\d+)$")


def stacks(path: Path) -> list[tuple[list[str], int]]:
    """The (frames, samples) of a collapsed-stack file, outermost frame first."""
    out = []
    for line in path.read_text().splitlines():
        m = _SAMPLE.match(line.strip())
        if m:
            out.append((m.group(1).split(";"), int(m.group(2))))
    return out


def split(records: list[tuple[list[str], int]]) -> dict[str, Counter[str]]:
    """The loop's samples by lane frame, by the frame below it, and by leaf."""
    by_lane: Counter[str] = Counter()
    below: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    for frames, n in records:
        inner = max((i for i, f in enumerate(frames) if any(name in f for name in LOOP)), default=None)
        if inner is None or any(NOT_LOOP.search(f) for f in frames):
            continue
        by_lane[frames[inner]] += n
        # the first named frame under it (an unnamed address is the binding's trampoline)
        below[next((f for f in frames[inner + 1:] if not f.startswith("0x")), "(itself)")] += n
        leaf[frames[-1]] += n
    return {"lane frame": by_lane, "below it": below, "leaf": leaf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for path in args.files:
        parts = split(stacks(path))
        total = sum(parts["lane frame"].values())
        print(f"== {path.name}: {total} samples in the loop")
        for name, counter in parts.items():
            print(f"  by {name}:")
            for frame, n in counter.most_common(args.top):
                print(f"    {n / max(total, 1):6.1%} {n:7d}  {frame[:150]}")


if __name__ == "__main__":
    main()
